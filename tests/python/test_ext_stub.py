"""flashdl/_ext.pyi, the extension's type stub, is made by the build from the compiled module
(nanobind's stub generator, CMakeLists.txt) and installed beside it; python/flashdl/_ext.pyi, which
editable installs and type checks of the source tree read, must be the same text, so that a change
of the bindings' signatures shows up here until the copy is regenerated."""

import pathlib

import pytest

import flashdl._ext

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "python" / "flashdl" / "_ext.pyi"
GENERATED = pathlib.Path(flashdl._ext.__file__).resolve().with_name("_ext.pyi")


def test_source_stub_is_the_generated_one():
    if not SOURCE.is_file():
        pytest.skip("not run from a source checkout")
    assert GENERATED.is_file(), f"the build installed no stub beside {flashdl._ext.__file__}"
    if GENERATED == SOURCE:
        pytest.skip("the extension was built into the source tree: no separate generated stub")
    assert GENERATED.read_text() == SOURCE.read_text(), (
        f"{SOURCE} differs from the stub the build generated ({GENERATED}); refresh it with "
        f"cp {GENERATED} {SOURCE}")
