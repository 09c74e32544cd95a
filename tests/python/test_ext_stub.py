"""flashdl/_ext.pyi, the extension's type stub, is made by the build from the compiled module
(nanobind's stub generator, CMakeLists.txt) and installed beside it; python/flashdl/_ext.pyi, which
editable installs and type checks of the source tree read, must be the same text, so that a change
of the bindings' signatures shows up here until the copy is regenerated."""

import pathlib

import pytest

import flashdl._ext

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "python" / "flashdl" / "_ext.pyi"
# Beside the module as it was imported (not through symlinks: tools/sanitize.sh links the package).
GENERATED = pathlib.Path(flashdl._ext.__file__).with_name("_ext.pyi")


def test_source_stub_is_the_generated_one():
    if not SOURCE.is_file():
        pytest.skip("not run from a source checkout")
    assert GENERATED.is_file(), f"the build installed no stub beside {flashdl._ext.__file__}"
    if GENERATED.resolve() == SOURCE:
        pytest.skip("the package's stub is the source copy itself (a package linked to the tree)")
    assert GENERATED.read_text() == SOURCE.read_text(), (
        f"{SOURCE} differs from the stub the build generated ({GENERATED}); refresh it with "
        f"cp {GENERATED} {SOURCE}")
