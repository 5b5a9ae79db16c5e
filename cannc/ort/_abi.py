"""ONNX Runtime's plugin-EP C ABI, declared by hand (ORT_EP_NOTES.md): the structures
cannc hands to ORT and the OrtApi / OrtEpApi / OrtModelEditorApi functions it calls.

No ORT header is copied: the tables of function pointers are append-only and stable
across ORT versions, so a function is reached by its slot (its index in the table) and a
ctypes prototype written from ORT's public documentation. Only what cannc calls is here.

Every structure cannc hands to ORT claims ``ORT_VERSION`` (1.23) and lays out exactly the
members up to that version; ORT reads no further.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_bool,
    c_char_p,
    c_int,
    c_int64,
    c_size_t,
    c_uint32,
    c_void_p,
)
from typing import Any

ORT_VERSION = 23          # the ABI cannc is written against (GetCapability/Compile)

# OrtErrorCode
ORT_OK, ORT_FAIL, ORT_INVALID_ARGUMENT = 0, 1, 2
# OrtHardwareDeviceType
DEVICE_CPU = 0
# OrtOpAttrType
(ATTR_UNDEFINED, ATTR_INT, ATTR_INTS, ATTR_FLOAT, ATTR_FLOATS, ATTR_STRING, ATTR_STRINGS,
 ATTR_GRAPH, ATTR_TENSOR) = range(9)
# ONNXType
ONNX_TYPE_TENSOR = 1
# OrtLoggingLevel
LOG_VERBOSE, LOG_INFO, LOG_WARNING, LOG_ERROR = 0, 1, 2, 3

P = c_void_p
Status = c_void_p          # OrtStatus*, NULL = success (what callbacks return)
STATUS = object()          # in the slot tables: returns an OrtStatus* (raise on error)

# -- OrtApi slots (index in the function table; ORT 1.29 headers, checked on 1.32) ---------
OrtApiSlots = {
    # name: (slot, restype, argtypes)
    "CreateStatus": (0, P, [c_int, c_char_p]),
    "GetErrorCode": (1, c_int, [P]),
    "GetErrorMessage": (2, c_char_p, [P]),
    "GetTensorMutableData": (51, STATUS, [P, POINTER(P)]),
    "CastTypeInfoToTensorInfo": (55, STATUS, [P, POINTER(P)]),
    "GetOnnxTypeFromTypeInfo": (56, STATUS, [P, POINTER(c_int)]),
    "GetTensorElementType": (60, STATUS, [P, POINTER(c_int)]),
    "GetDimensionsCount": (61, STATUS, [P, POINTER(c_size_t)]),
    "GetDimensions": (62, STATUS, [P, POINTER(c_int64), c_size_t]),
    "GetSymbolicDimensions": (63, STATUS, [P, POINTER(c_char_p), c_size_t]),
    "GetTensorTypeAndShape": (65, STATUS, [P, POINTER(P)]),
    "ReleaseStatus": (93, None, [P]),
    "ReleaseValue": (96, None, [P]),
    "ReleaseTensorTypeAndShapeInfo": (99, None, [P]),
    "CreateOpAttr": (211, STATUS, [c_char_p, P, c_int, c_int, POINTER(P)]),
    "ReleaseOpAttr": (212, None, [P]),
    "HasSessionConfigEntry": (237, STATUS, [P, c_char_p, POINTER(c_int)]),
    "GetSessionConfigEntry": (238, STATUS, [P, c_char_p, c_char_p, POINTER(c_size_t)]),
    "Logger_LogMessage": (247, STATUS, [P, c_int, c_char_p, c_char_p, c_int, c_char_p]),
    "ReadOpAttr": (272, STATUS, [P, c_int, P, c_size_t, POINTER(c_size_t)]),
    "GetValueInfoName": (289, STATUS, [P, POINTER(c_char_p)]),
    "GetValueInfoTypeInfo": (290, STATUS, [P, POINTER(P)]),
    "GetModelEditorApi": (291, P, []),
    "GetKeyValuePairs": (298, None, [P, POINTER(POINTER(c_char_p)), POINTER(POINTER(c_char_p)),
                                     POINTER(c_size_t)]),
    "ReleaseKeyValuePairs": (300, None, [P]),
    "HardwareDevice_Type": (307, c_int, [P]),
    "GetEpApi": (317, P, []),
    "ValueInfo_GetInitializerValue": (326, STATUS, [P, POINTER(P)]),
    "ValueInfo_IsConstantInitializer": (331, STATUS, [P, POINTER(c_bool)]),
    "Graph_GetModelPath": (334, STATUS, [P, POINTER(c_char_p)]),
    "Graph_GetOnnxIRVersion": (335, STATUS, [P, POINTER(c_int64)]),
    "Graph_GetNumOperatorSets": (336, STATUS, [P, POINTER(c_size_t)]),
    "Graph_GetOperatorSets": (337, STATUS, [P, POINTER(c_char_p), POINTER(c_int64), c_size_t]),
    "Graph_GetNumInputs": (338, STATUS, [P, POINTER(c_size_t)]),
    "Graph_GetInputs": (339, STATUS, [P, POINTER(P), c_size_t]),
    "Graph_GetNumOutputs": (340, STATUS, [P, POINTER(c_size_t)]),
    "Graph_GetOutputs": (341, STATUS, [P, POINTER(P), c_size_t]),
    "Graph_GetNumInitializers": (342, STATUS, [P, POINTER(c_size_t)]),
    "Graph_GetInitializers": (343, STATUS, [P, POINTER(P), c_size_t]),
    "Graph_GetNumNodes": (344, STATUS, [P, POINTER(c_size_t)]),
    "Graph_GetNodes": (345, STATUS, [P, POINTER(P), c_size_t]),
    "Node_GetId": (348, STATUS, [P, POINTER(c_size_t)]),
    "Node_GetName": (349, STATUS, [P, POINTER(c_char_p)]),
    "Node_GetOperatorType": (350, STATUS, [P, POINTER(c_char_p)]),
    "Node_GetDomain": (351, STATUS, [P, POINTER(c_char_p)]),
    "Node_GetSinceVersion": (352, STATUS, [P, POINTER(c_int)]),
    "Node_GetNumInputs": (353, STATUS, [P, POINTER(c_size_t)]),
    "Node_GetInputs": (354, STATUS, [P, POINTER(P), c_size_t]),
    "Node_GetNumOutputs": (355, STATUS, [P, POINTER(c_size_t)]),
    "Node_GetOutputs": (356, STATUS, [P, POINTER(P), c_size_t]),
    "Node_GetNumImplicitInputs": (357, STATUS, [P, POINTER(c_size_t)]),
    "Node_GetImplicitInputs": (358, STATUS, [P, POINTER(P), c_size_t]),
    "Node_GetNumAttributes": (359, STATUS, [P, POINTER(c_size_t)]),
    "Node_GetAttributes": (360, STATUS, [P, POINTER(P), c_size_t]),
    "Node_GetAttributeByName": (361, STATUS, [P, c_char_p, POINTER(P)]),
    "OpAttr_GetTensorAttributeAsOrtValue": (362, STATUS, [P, POINTER(P)]),
    "OpAttr_GetType": (363, STATUS, [P, POINTER(c_int)]),
    "OpAttr_GetName": (364, STATUS, [P, POINTER(c_char_p)]),
    "Node_GetNumSubgraphs": (365, STATUS, [P, POINTER(c_size_t)]),
    "GetTensorData": (378, STATUS, [P, POINTER(P)]),
    "GetSessionOptionsConfigEntries": (379, STATUS, [P, POINTER(P)]),
}

OrtEpApiSlots = {
    "CreateEpDevice": (0, STATUS, [P, P, P, P, POINTER(P)]),
    "EpGraphSupportInfo_AddNodesToFuse": (2, STATUS, [P, POINTER(P), c_size_t, P]),
    "EpGraphSupportInfo_AddSingleNode": (3, STATUS, [P, P]),
    "NodeComputeContext_NodeName": (4, c_char_p, [P]),
}

ModelEditorApiSlots = {
    "CreateNode": (6, STATUS, [c_char_p, c_char_p, c_char_p, POINTER(c_char_p), c_size_t,
                               POINTER(c_char_p), c_size_t, POINTER(P), c_size_t, POINTER(P)]),
}


class OrtCallError(Exception):
    """An OrtApi call returned an error status (its code and message)."""

    def __init__(self, func: str, code: int, message: str) -> None:
        super().__init__(f"{func}: {message}")
        self.code = code


class FunctionTable:
    """A table of C function pointers (OrtApi, OrtEpApi...) called by slot. A call whose
    prototype returns a status raises OrtCallError when ORT reports an error."""

    def __init__(self, address: int, slots: dict[str, tuple[int, Any, list[Any]]],
                 api: FunctionTable | None = None) -> None:
        if not address:
            raise ValueError("null function table")
        self.address = address
        self._slots = slots
        self._fns: dict[str, Any] = {}
        self._api = api or self        # the OrtApi (for statuses)

    def fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            slot, res, args = self._slots[name]
            ptr = ctypes.c_void_p.from_address(self.address + slot * ctypes.sizeof(c_void_p))
            if not ptr.value:
                raise OrtCallError(name, ORT_FAIL, "this onnxruntime does not provide it")
            f = CFUNCTYPE(c_void_p if res is STATUS else res, *args)(ptr.value)
            self._fns[name] = f
        return f

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._slots:
            raise AttributeError(name)
        f = self.fn(name)
        if self._slots[name][1] is not STATUS:
            return f

        def call(*args: Any) -> None:
            st = f(*args)
            if st:
                raise self._api.status_error(name, st)
        return call

    def status_error(self, func: str, status: int) -> OrtCallError:
        msg = self.fn("GetErrorMessage")(status)
        code = self.fn("GetErrorCode")(status)
        self.fn("ReleaseStatus")(status)
        return OrtCallError(func, code, (msg or b"").decode("utf-8", "replace"))

    def make_status(self, code: int, message: str) -> int:
        """A new OrtStatus (ORT takes ownership when it is returned to it)."""
        return self.fn("CreateStatus")(code, message.encode("utf-8", "replace")) or 0


# -- the structures cannc hands to ORT (claim ORT_VERSION; members up to 1.23 only) ------------
def _cb(restype: Any, *args: Any) -> Any:
    return CFUNCTYPE(restype, *args)


# OrtEpFactory
F_GetName = _cb(P, P)
F_GetVendor = _cb(P, P)
F_GetSupportedDevices = _cb(Status, P, POINTER(P), c_size_t, POINTER(P), c_size_t,
                            POINTER(c_size_t))
F_CreateEp = _cb(Status, P, POINTER(P), POINTER(P), c_size_t, P, P, POINTER(P))
F_ReleaseEp = _cb(None, P, P)
F_GetVendorId = _cb(c_uint32, P)
F_GetVersion = _cb(P, P)
F_ValidateCompat = _cb(Status, P, POINTER(P), c_size_t, c_char_p, POINTER(c_int))
F_CreateAllocator = _cb(Status, P, P, P, POINTER(P))
F_ReleaseAllocator = _cb(None, P, P)
F_CreateDataTransfer = _cb(Status, P, POINTER(P))
F_IsStreamAware = _cb(c_bool, P)
F_CreateSyncStream = _cb(Status, P, P, P, POINTER(P))


class OrtEpFactory(Structure):
    _fields_ = [
        ("ort_version_supported", c_uint32),
        ("GetName", F_GetName),
        ("GetVendor", F_GetVendor),
        ("GetSupportedDevices", F_GetSupportedDevices),
        ("CreateEp", F_CreateEp),
        ("ReleaseEp", F_ReleaseEp),
        ("GetVendorId", F_GetVendorId),
        ("GetVersion", F_GetVersion),
        ("ValidateCompiledModelCompatibilityInfo", F_ValidateCompat),
        ("CreateAllocator", F_CreateAllocator),
        ("ReleaseAllocator", F_ReleaseAllocator),
        ("CreateDataTransfer", F_CreateDataTransfer),
        ("IsStreamAware", F_IsStreamAware),
        ("CreateSyncStreamForDevice", F_CreateSyncStream),
    ]


# OrtEp
E_GetName = _cb(P, P)
E_GetCapability = _cb(Status, P, P, P)
E_Compile = _cb(Status, P, POINTER(P), POINTER(P), c_size_t, POINTER(P), POINTER(P))
E_ReleaseNodeComputeInfos = _cb(None, P, POINTER(P), c_size_t)


class OrtEp(Structure):
    _fields_ = [
        ("ort_version_supported", c_uint32),
        ("GetName", E_GetName),
        ("GetCapability", E_GetCapability),
        ("Compile", E_Compile),
        ("ReleaseNodeComputeInfos", E_ReleaseNodeComputeInfos),
        # optional members (NULL): GetPreferredDataLayout, ShouldConvertDataLayoutForOp,
        # SetDynamicOptions, OnRunStart, OnRunEnd, CreateAllocator, CreateSyncStreamForDevice,
        # GetCompiledModelCompatibilityInfo
        ("optional", c_void_p * 8),
    ]


# OrtNodeComputeInfo
N_CreateState = _cb(Status, P, P, POINTER(P))
N_ReleaseState = _cb(None, P, P)


class OrtNodeComputeInfo(Structure):
    _fields_ = [
        ("ort_version_supported", c_uint32),
        ("CreateState", N_CreateState),
        ("Compute", c_void_p),          # native: cannc_compute in the shim
        ("ReleaseState", N_ReleaseState),
    ]


class OrtNodeFusionOptions(Structure):
    _fields_ = [
        ("ort_version_supported", c_uint32),
        ("drop_constant_initializers", c_bool),
    ]


# OrtApiBase: { const OrtApi* (*GetApi)(uint32_t version); const char* (*GetVersionString)(void); }
GetApiFn = CFUNCTYPE(P, c_uint32)
GetVersionStringFn = CFUNCTYPE(c_char_p)


class OrtApiBase(Structure):
    _fields_ = [("GetApi", GetApiFn), ("GetVersionString", GetVersionStringFn)]


def strings(values: list[str]) -> tuple[Any, list[bytes]]:
    """A C array of char* for `values` (and the bytes objects that keep it alive)."""
    keep = [v.encode() for v in values]
    arr = (c_char_p * max(len(keep), 1))(*keep)
    return arr, keep
