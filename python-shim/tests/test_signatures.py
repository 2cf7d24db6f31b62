"""Every ctypes declaration matches include/marconi.h: the same functions,
argument counts and types, return types, and struct fields in order."""

import ctypes
import re

from marconi import _lib

SCALARS = {
    "uint8_t": ctypes.c_uint8,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "size_t": ctypes.c_size_t,
    "double": ctypes.c_double,
    "bool": ctypes.c_bool,
    "marconi_status": ctypes.c_uint32,
    "marconi_pml_segment_kind": ctypes.c_uint32,
    "marconi_pml_served_how": ctypes.c_uint32,
    "marconi_pml_tokenize_fn": _lib._pml_abi.TOKENIZE_FN,
}


def c_to_ctypes(decl: str):
    """The ctypes type for a C type written in the header."""
    t = decl.replace("const ", "").replace("struct ", "").strip()
    stars = t.count("*")
    base = t.replace("*", "").strip()
    if base == "void" and stars == 0:
        return None
    if base == "void" and stars == 1:
        return ctypes.c_void_p
    if base == "char" and stars == 1:
        return ctypes.c_char_p
    if base in _lib.CALLBACK_TYPES and stars == 0:
        return _lib.CALLBACK_TYPES[base]
    if base in ("marconi_cache", "marconi_pool", "marconi_host_pool", "marconi_pooled_cache", "marconi_events", "marconi_pml_schema", "marconi_pml_cache", "marconi_store", "marconi_tiered"):  # opaque handles
        return ctypes.c_void_p if stars == 1 else ctypes.POINTER(ctypes.c_void_p)
    inner = SCALARS.get(base) or _lib.STRUCTS.get(base)
    assert inner is not None, f"unknown C type {decl!r}"
    for _ in range(stars):
        inner = ctypes.POINTER(inner)
    return inner


def header_functions(text: str) -> dict:
    body = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = {}
    for m in re.finditer(r"^([A-Za-z_][\w \*]*?)\b(marconi_\w+)\(([^)]*)\);", body, flags=re.M):
        ret, name, args = m.group(1).strip(), m.group(2), " ".join(m.group(3).split())
        params = [] if args in ("", "void") else [a.strip() for a in args.split(",")]
        types = [re.sub(r"\s*\b\w+$", "", p) if not p.endswith("*") else p for p in params]
        out[name] = (ret, types)
    return out


def header_structs(text: str) -> dict:
    body = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = {}
    for m in re.finditer(r"typedef struct (marconi_\w+) \{(.*?)\} \1;", body, flags=re.S):
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if decl:
                ty, name = decl.rsplit(" ", 1)
                while name.startswith("*"):
                    ty, name = ty + "*", name[1:]
                if "[" in name:  # a fixed array field: its length when a number
                    name, dim = name.split("[")[0], name.split("[")[1].rstrip("]")
                    ty = ty + (f"[{dim}]" if dim.isdigit() else "[]")
                fields.append((name, ty))
        out[m.group(1)] = fields
    return out


def test_every_function_is_declared_with_the_header_types(header_text):
    funcs = header_functions(header_text)
    assert len(funcs) >= 17
    assert set(funcs) == set(_lib.SIGNATURES), "functions differ between marconi.h and _lib.SIGNATURES"
    for name, (ret, args) in funcs.items():
        restype, argtypes = _lib.SIGNATURES[name]
        assert len(argtypes) == len(args), f"{name}: {len(argtypes)} ctypes args vs {len(args)} in the header"
        assert c_to_ctypes(ret) == restype, f"{name}: return {ret}"
        for i, (c, py) in enumerate(zip(args, argtypes)):
            assert c_to_ctypes(c) == py, f"{name} argument {i}: {c} vs {py}"


def test_every_struct_matches_the_header(header_text):
    structs = header_structs(header_text)
    assert set(structs) == set(_lib.STRUCTS)
    for name, fields in structs.items():
        cls = _lib.STRUCTS[name]
        assert [f for f, _ in cls._fields_] == [f for f, _ in fields], name
        for (fname, ctype), (_, pytype) in zip(fields, cls._fields_):
            array = re.fullmatch(r"(.*)\[(\d+)\]", ctype)
            if ctype == "char[]":  # char message[MARCONI_PML_ERROR_MESSAGE_BYTES]
                want = ctypes.c_char * _lib._pml_abi.MESSAGE_BYTES
            elif array:  # uint64_t hits_by_tier[3]
                want = c_to_ctypes(array.group(1)) * int(array.group(2))
            else:
                want = c_to_ctypes(ctype)
            if (name in ("marconi_cache_config", "marconi_plan_request") and fname == "model_preset") or (
                name == "marconi_events_config" and ctype == "const char*"
            ):
                want = ctypes.c_char_p
            assert want == pytype, f"{name}.{fname}: {ctype} vs {pytype}"


def test_loaded_library_exports_every_function():
    lib = _lib.load()
    for name in _lib.SIGNATURES:
        assert hasattr(lib, name)


def test_constants_match(header_text):
    assert "#define MARCONI_NO_SLOT UINT32_MAX" in header_text
    assert _lib.NO_SLOT == 2**32 - 1
    from marconi.cache import STATUS_NAMES
    for value, name in enumerate(STATUS_NAMES):
        assert f"MARCONI_STATUS_{name} = {value}," in header_text
    assert f"MARCONI_STATUS_{STATUS_NAMES[-1]} = {len(STATUS_NAMES) - 1}," in header_text
    assert f"= {len(STATUS_NAMES)}," not in header_text.split("enum marconi_status")[1].split("};")[0]
