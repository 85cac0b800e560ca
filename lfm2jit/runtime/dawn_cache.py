"""Dawn's blob cache, given to a device through a DawnCacheDeviceDescriptor that wgpudawn does not define.

Dawn asks a device's load callback for every artefact it can reuse (Tint's SPIR-V of a shader, a
pipeline's Vulkan pipeline cache data) and hands each one it made to the store callback.
wgpudawn's cffi module lacks that struct, so it is declared here in a cffi module of lfm2jit's own,
as Dawn's dawn.json of its 2026 builds has it: the callbacks come in callback-info structs
(next, callback, two userdata) and take the key's size before the key. (The older layout, two bare
function pointers and one userdata, is what a first attempt declared; Dawn v20261009 then called
the store function with a load's arguments and crashed.) wgpudawn builds the device descriptor
itself: while a device is requested, the struct is chained behind the Dawn toggles descriptor it
makes (the one seam its request offers).
"""
from __future__ import annotations

import contextlib
import threading

import cffi

from .blob_cache import BlobCache

S_TYPE_DAWN_CACHE_DEVICE_DESCRIPTOR = 0x00050007   # WGPUSType_DawnCacheDeviceDescriptor (dawn.json)

ffi = cffi.FFI()
ffi.cdef("""
typedef struct WGPUChainedStruct { struct WGPUChainedStruct * next; uint32_t sType; } WGPUChainedStruct;
typedef struct WGPUStringView { const char * data; size_t length; } WGPUStringView;
typedef size_t (*WGPUDawnLoadCacheDataCallback)(size_t keySize, const uint8_t * key, size_t valueSize,
                                                uint8_t * value, void * userdata1, void * userdata2);
typedef void (*WGPUDawnStoreCacheDataCallback)(size_t keySize, const uint8_t * key, size_t valueSize,
                                               const uint8_t * value, void * userdata1, void * userdata2);
typedef struct WGPUDawnLoadCacheDataCallbackInfo {
    WGPUChainedStruct * nextInChain;
    WGPUDawnLoadCacheDataCallback callback;
    void * userdata1;
    void * userdata2;
} WGPUDawnLoadCacheDataCallbackInfo;
typedef struct WGPUDawnStoreCacheDataCallbackInfo {
    WGPUChainedStruct * nextInChain;
    WGPUDawnStoreCacheDataCallback callback;
    void * userdata1;
    void * userdata2;
} WGPUDawnStoreCacheDataCallbackInfo;
typedef struct WGPUDawnCacheDeviceDescriptor {
    WGPUChainedStruct chain;
    WGPUStringView isolationKey;
    WGPUDawnLoadCacheDataCallbackInfo loadDataCallbackInfo;
    WGPUDawnStoreCacheDataCallbackInfo storeDataCallbackInfo;
} WGPUDawnCacheDeviceDescriptor;
""")


class DawnCacheDescriptor:
    """The descriptor and the callbacks behind it; keep it alive as long as the device."""

    def __init__(self, cache: BlobCache):
        self.cache = cache
        self._found: dict[bytes, bytes] = {}       # Dawn asks a value's size, then for the value
        self._lock = threading.Lock()              # ... from its compiling threads
        self._key = ffi.new("char[]", cache.scope.encode())
        self._load = ffi.callback("WGPUDawnLoadCacheDataCallback", self._load_data, onerror=_load_failed)
        self._store = ffi.callback("WGPUDawnStoreCacheDataCallback", self._store_data, onerror=_store_failed)
        self.struct = ffi.new("WGPUDawnCacheDeviceDescriptor *")
        self.struct.chain.sType = S_TYPE_DAWN_CACHE_DEVICE_DESCRIPTOR
        self.struct.isolationKey.data = self._key
        self.struct.isolationKey.length = len(cache.scope.encode())
        self.struct.loadDataCallbackInfo.callback = self._load
        self.struct.storeDataCallbackInfo.callback = self._store

    def _load_data(self, key_size, key, value_size, value, userdata1, userdata2) -> int:
        """Dawn's protocol: with no buffer, the value's size (0: a miss); with one, the value copied in."""
        k = bytes(ffi.buffer(key, key_size))
        if value == ffi.NULL or value_size == 0:
            found = self.cache.load(k)
            if found is None:
                return 0
            with self._lock:
                self._found[k] = found
            return len(found)
        with self._lock:
            found = self._found.pop(k, None)
        if found is None or len(found) > value_size:
            return 0
        ffi.memmove(value, found, len(found))
        return len(found)

    def _store_data(self, key_size, key, value_size, value, userdata1, userdata2) -> None:
        self.cache.store(bytes(ffi.buffer(key, key_size)), bytes(ffi.buffer(value, value_size)))

    @contextlib.contextmanager
    def chained_to_device_requests(self):
        """While inside, wgpudawn's device requests carry this descriptor (behind their toggles)."""
        from wgpudawn.backends.dawn import _api
        from wgpudawn.backends.dawn._ffi import ffi as dawn_ffi
        ours = dawn_ffi.cast("WGPUChainedStruct *", int(ffi.cast("uintptr_t", self.struct)))
        make_toggles = _api.new_toggles_struct

        def toggles_then_cache(enabled, disabled, keepalive):
            toggles = make_toggles(enabled, disabled, keepalive)
            if toggles == dawn_ffi.NULL:
                return ours
            toggles.next = ours
            return toggles
        _api.new_toggles_struct = toggles_then_cache
        try:
            yield
        finally:
            _api.new_toggles_struct = make_toggles


def _load_failed(*exc) -> int:
    return 0          # an error inside the callback is a miss: Dawn compiles


def _store_failed(*exc) -> None:
    return None       # an unwritable cache only costs the next process a compile
