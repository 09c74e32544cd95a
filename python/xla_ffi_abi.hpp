// The part of XLA's FFI C ABI (xla/ffi/api/c_api.h, API version 0.1 onward) that flashdl's JAX
// handlers use, declared here so that the handlers build without jax or jaxlib installed
// (docs/howto/jax.md says why). The layouts are XLA's, field for field: a versioned, append-only C
// ABI in which every struct carries its size. tests/python/test_jax.py compiles this header next
// to the installed jaxlib's c_api.h and checks every offset, size and enum value against it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashdl::xla_abi {

// The FFI API version these handlers are written against and report to XLA at registration.
// XLA accepts handlers from its minimum supported version up to its own; 0.1 is the oldest
// version whose structs carry everything used below.
constexpr int kApiMajor = 0;
constexpr int kApiMinor = 1;

enum ExtensionType : int { kExtensionMetadata = 1 };

struct ExtensionBase {
  size_t struct_size;
  ExtensionType type;
  ExtensionBase* next;
};

struct ApiVersion {
  size_t struct_size;
  ExtensionBase* extension_start;
  int major_version;
  int minor_version;
};

struct FfiError;  // opaque, owned by XLA

enum ErrorCode : int {
  kOk = 0,
  kInvalidArgument = 3,
  kUnimplemented = 12,
  kInternal = 13,
};

struct ErrorCreateArgs {
  size_t struct_size;
  ExtensionBase* extension_start;
  const char* message;
  ErrorCode errc;
};

enum DataType : int {
  kPred = 1,
  kS8 = 2,
  kS16 = 3,
  kS32 = 4,
  kS64 = 5,
  kU8 = 6,
  kU16 = 7,
  kU32 = 8,
  kU64 = 9,
  kF16 = 10,
  kF32 = 11,
  kF64 = 12,
  kBF16 = 16,
};

struct Buffer {
  size_t struct_size;
  ExtensionBase* extension_start;
  DataType dtype;
  void* data;
  int64_t rank;
  int64_t* dims;
};

enum ArgType : int { kArgBuffer = 1 };
enum RetType : int { kRetBuffer = 1 };
enum AttrType : int { kAttrArray = 1, kAttrDictionary = 2, kAttrScalar = 3, kAttrString = 4 };

struct ExecutionContext;  // opaque

struct ByteSpan {
  const char* ptr;
  size_t len;
};

struct Scalar {
  DataType dtype;
  void* value;
};

enum ExecutionStage : int { kInstantiate = 0, kPrepare = 1, kInitialize = 2, kExecute = 3 };

struct Args {
  size_t struct_size;
  ExtensionBase* extension_start;
  int64_t size;
  ArgType* types;
  void** args;
};

struct Rets {
  size_t struct_size;
  ExtensionBase* extension_start;
  int64_t size;
  RetType* types;
  void** rets;
};

// Sorted by name.
struct Attrs {
  size_t struct_size;
  ExtensionBase* extension_start;
  int64_t size;
  AttrType* types;
  ByteSpan** names;
  void** attrs;
};

struct Api;

struct CallFrame {
  size_t struct_size;
  ExtensionBase* extension_start;
  const Api* api;
  ExecutionContext* ctx;
  ExecutionStage stage;
  Args args;
  Rets rets;
  Attrs attrs;
};

using Handler = FfiError*(CallFrame* call_frame);

using HandlerTraits = uint32_t;

struct StreamGetArgs {
  size_t struct_size;
  ExtensionBase* extension_start;
  ExecutionContext* ctx;
  void* stream;  // out: a cudaStream_t on CUDA
};

struct DeviceOrdinalGetArgs {
  size_t struct_size;
  ExtensionBase* extension_start;
  ExecutionContext* ctx;
  int32_t device_ordinal;  // out
};

// The registration-time query: XLA calls the handler with this extension first in the call frame
// and expects the API version (and traits) filled in.
struct TypeId {
  int64_t type_id;
};

struct Metadata {
  size_t struct_size;
  ApiVersion api_version;
  HandlerTraits traits;
  TypeId state_type_id;
};

struct MetadataExtension {
  ExtensionBase extension_base;
  Metadata* metadata;
};

using ErrorCreateFn = FfiError*(ErrorCreateArgs*);
using StreamGetFn = FfiError*(StreamGetArgs*);
using DeviceOrdinalGetFn = FfiError*(DeviceOrdinalGetArgs*);
using UnusedFn = void;

// The API table, in XLA's order. Only the three typed entries are called here.
struct Api {
  size_t struct_size;
  ExtensionBase* extension_start;
  ApiVersion api_version;
  const void* internal_api;

  ErrorCreateFn* error_create;
  UnusedFn* error_get_message;
  UnusedFn* error_destroy;
  UnusedFn* handler_register;
  StreamGetFn* stream_get;
  UnusedFn* type_register;
  UnusedFn* execution_context_get;
  UnusedFn* state_set;
  UnusedFn* state_get;
  UnusedFn* device_memory_allocate;
  UnusedFn* device_memory_free;
  UnusedFn* thread_pool_schedule;
  UnusedFn* thread_pool_num_threads;
  UnusedFn* future_create;
  UnusedFn* future_set_available;
  UnusedFn* future_set_error;
  UnusedFn* run_id_get;
  DeviceOrdinalGetFn* device_ordinal_get;
};

// XLA's struct sizes run to the last field it counts (XLA_FFI_STRUCT_SIZE): for the call frame
// that is `attrs`, for the metadata `traits`.
constexpr size_t kCallFrameSize = offsetof(CallFrame, attrs) + sizeof(Attrs);
constexpr size_t kMetadataSize = offsetof(Metadata, traits) + sizeof(HandlerTraits);
constexpr size_t kMetadataExtensionSize = offsetof(MetadataExtension, metadata) + sizeof(Metadata*);
constexpr size_t kApiVersionSize = offsetof(ApiVersion, minor_version) + sizeof(int);
constexpr size_t kErrorCreateArgsSize = offsetof(ErrorCreateArgs, errc) + sizeof(ErrorCode);
constexpr size_t kStreamGetArgsSize = offsetof(StreamGetArgs, stream) + sizeof(void*);
constexpr size_t kDeviceOrdinalGetArgsSize = offsetof(DeviceOrdinalGetArgs, device_ordinal) +
                                             sizeof(int32_t);
constexpr size_t kBufferSize = offsetof(Buffer, dims) + sizeof(int64_t*);

}  // namespace flashdl::xla_abi
