"""The C kernels' interface, read from its one header (csrc/hybridserve_kernels.h).

`KernelLibrary` binds every declared function with its ctypes types and exact arity (a wrong argument
count raises TypeError), and checks at load that the library exports each one and that the ctypes
struct mirrors have the compiled sizes and field offsets (csrc/abi_layout.c): a mismatch is a
`KernelAbiError`, not memory corruption. The parser reads the plain C subset the header describes.
"""

from __future__ import annotations

import ctypes
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

HEADER = Path(__file__).with_name("csrc") / "hybridserve_kernels.h"

# C scalar types the header may use, and their ctypes (void only as a return type)
_SCALARS: dict[str, Any] = {
    "void": None, "char": ctypes.c_char, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
    "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16, "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
}
_IDENTIFIER = r"[A-Za-z_]\w*"
_DECLARATOR = re.compile(rf"^(?P<stars>(?:\*\s*(?:const\b\s*)?)*)(?P<name>{_IDENTIFIER})$")
_PROTOTYPE = re.compile(r"^(?P<head>.+?)\((?P<params>[^()]*)\)$", re.DOTALL)
_STRUCT = re.compile(rf"^typedef\s+struct\s*\{{(?P<body>[^{{}}]*)\}}\s*(?P<name>{_IDENTIFIER})$", re.DOTALL)
_ENUM = re.compile(r"^enum\s*\{(?P<body>[^{}]*)\}$", re.DOTALL)
_CONSTANT = re.compile(rf"^(?P<name>{_IDENTIFIER})\s*=\s*(?P<value>-?\d+)$")


class KernelAbiError(RuntimeError):
    """The header cannot be read, or the compiled library does not match it."""


@dataclass(frozen=True)
class Declaration:
    """One declared name with its C type: `base` (scalar or struct name, no const) and `pointers`."""

    base: str
    pointers: int
    name: str

    def c_type(self) -> str:
        """The type as C spells it, without const (`float *`, `int64_t`)."""
        return self.base + (" " + "*" * self.pointers if self.pointers else "")


@dataclass(frozen=True)
class Prototype:
    """A declared function: its return type (a Declaration named after the function) and parameters."""

    result: Declaration
    params: tuple[Declaration, ...]

    @property
    def name(self) -> str:
        """The function's name."""
        return self.result.name


@dataclass(frozen=True)
class HeaderAbi:
    """What the header declares: functions, structs (fields in order) and integer constants."""

    functions: dict[str, Prototype]
    structs: dict[str, tuple[Declaration, ...]]
    constants: dict[str, int]


def _statements(text: str) -> list[str]:
    """The header's top-level statements (up to each `;` outside braces), without comments and `#` lines."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.MULTILINE)
    statements, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == ";" and depth == 0:
            statements.append(" ".join(text[start:index].split()))
            start = index + 1
    if text[start:].strip():
        raise KernelAbiError(f"{HEADER.name}: text after the last ';': {text[start:].strip()[:80]!r}")
    return [statement for statement in statements if statement]


def _declarations(text: str, known_structs: set[str]) -> list[Declaration]:
    """`[const] type [*]name[, [*]name...]` as Declarations (one per name)."""
    words = text.replace("*", " * ").split()
    while words and words[0] == "const":
        words.pop(0)
    if not words or (words[0] not in _SCALARS and words[0] not in known_structs):
        raise KernelAbiError(f"{HEADER.name}: unknown type in {text!r} (see the header's comment for the types "
                             "kernel_abi.py reads)")
    base, declarators = words[0], " ".join(words[1:]).split(",")
    declarations = []
    for declarator in declarators:
        match = _DECLARATOR.match(" ".join(declarator.split()))
        if match is None:
            raise KernelAbiError(f"{HEADER.name}: cannot read the declarator {declarator.strip()!r} in {text!r}")
        declarations.append(Declaration(base, match["stars"].count("*"), match["name"]))
    return declarations


def _prototype(statement: str, known_structs: set[str]) -> Prototype:
    match = _PROTOTYPE.match(statement)
    if match is None:
        raise KernelAbiError(f"{HEADER.name}: cannot read the declaration {statement[:100]!r}")
    (result,) = _declarations(match["head"], known_structs)
    params_text = match["params"].strip()
    params: list[Declaration] = []
    if params_text != "void":
        for param in params_text.split(","):
            declared = _declarations(param, known_structs)
            if len(declared) != 1:
                raise KernelAbiError(f"{HEADER.name}: {result.name}: a parameter needs a type and a name: {param!r}")
            params += declared
    if any(param.base == "void" and not param.pointers for param in params):
        raise KernelAbiError(f"{HEADER.name}: {result.name}: a void parameter")
    return Prototype(result, tuple(params))


def parse_header(text: str) -> HeaderAbi:
    """The functions, structs and constants a header in the subset kernel_abi.py reads declares."""
    functions: dict[str, Prototype] = {}
    structs: dict[str, tuple[Declaration, ...]] = {}
    constants: dict[str, int] = {}
    for statement in _statements(text):
        if (enum := _ENUM.match(statement)) is not None:
            for item in filter(None, (part.strip() for part in enum["body"].split(","))):
                constant = _CONSTANT.match(item)
                if constant is None:
                    raise KernelAbiError(f"{HEADER.name}: an enum constant needs an explicit value: {item!r}")
                constants[constant["name"]] = int(constant["value"])
        elif (struct := _STRUCT.match(statement)) is not None:
            fields = [field for part in struct["body"].split(";") if part.strip()
                      for field in _declarations(part, set(structs))]
            if any(field.base == "void" and not field.pointers for field in fields):
                raise KernelAbiError(f"{HEADER.name}: {struct['name']}: a void field")
            structs[struct["name"]] = tuple(fields)
        else:
            prototype = _prototype(statement, set(structs))
            if prototype.name in functions:
                raise KernelAbiError(f"{HEADER.name}: {prototype.name} is declared twice")
            functions[prototype.name] = prototype
    return HeaderAbi(functions, structs, constants)


@lru_cache(maxsize=1)
def header_abi() -> HeaderAbi:
    """The parsed csrc/hybridserve_kernels.h (read once per process)."""
    return parse_header(HEADER.read_text())


def _ctype(declaration: Declaration, mirrors: dict[str, type[ctypes.Structure]]) -> Any:
    """The ctypes type of a declaration, given the struct mirrors known here ({} for a function's
    parameters and result): one pointer to a mirrored struct is typed (so a ctypes array can be assigned
    to a field), other pointers are addresses, a mirrored struct by value is its mirror."""
    if declaration.pointers == 1 and declaration.base in mirrors:
        return ctypes.POINTER(mirrors[declaration.base])
    if declaration.pointers:
        return ctypes.c_void_p
    if declaration.base in mirrors:
        return mirrors[declaration.base]
    if declaration.base not in _SCALARS:
        raise KernelAbiError(f"{declaration.name}: no ctypes type for {declaration.base} (a struct passed by value?)")
    return _SCALARS[declaration.base]


# ctypes lets a call to a cdecl-flagged function pass extra arguments (C varargs); without the flag it
# checks the count exactly (x86-64 and AArch64 have one calling convention, so nothing else changes).
_EXACT_ARITY_FLAGS = 0 if sys.platform != "win32" else ctypes._FUNCFLAG_CDECL  # type: ignore[attr-defined]


def function_type(prototype: Prototype) -> Any:
    """A ctypes function type of this prototype's types and exact arity (bind with `(name, cdll)`)."""
    namespace = {"_argtypes_": tuple(_ctype(param, {}) for param in prototype.params),
                 "_restype_": _ctype(prototype.result, {}), "_flags_": _EXACT_ARITY_FLAGS}
    return type(f"{prototype.name}_function", (ctypes._CFuncPtr,), namespace)  # type: ignore[attr-defined]


def bind(cdll: ctypes.CDLL, name: str, abi: HeaderAbi | None = None) -> Any:
    """The function `name` of `cdll` with the header's signature (also for test builds of some sources)."""
    abi = abi or header_abi()
    if name not in abi.functions:
        raise KernelAbiError(f"{HEADER.name} declares no function {name}")
    try:
        return function_type(abi.functions[name])((name, cdll))
    except AttributeError as exc:
        raise KernelAbiError(f"the kernels library does not export {name}, which {HEADER.name} declares") from exc


def _fields(struct: str, mirrors: dict[str, type[ctypes.Structure]]) -> list[tuple[str, Any]]:
    """A mirror's `_fields_`, from the header's declaration of `struct`."""
    abi = header_abi()
    if struct not in abi.structs:
        raise KernelAbiError(f"{HEADER.name} declares no struct {struct}")
    return [(field.name, _ctype(field, mirrors)) for field in abi.structs[struct]]


class Linear(ctypes.Structure):
    """A linear's weight: float32, bfloat16, or int8 with per-output float32 scales (the header's
    struct of the same name)."""

    _fields_ = _fields("Linear", {})


class DecodeLayer(ctypes.Structure):
    """One decoder layer's weights for the C decode step (the header's struct of the same name)."""

    _fields_ = _fields("DecodeLayer", {"Linear": Linear})


class DecodeModel(ctypes.Structure):
    """The model's shape, weights and state storage for the C decode step (the header's struct)."""

    _fields_ = _fields("DecodeModel", {"Linear": Linear, "DecodeLayer": DecodeLayer})


# Every struct the header shares with Python, by its C name.
MIRRORS: dict[str, type[ctypes.Structure]] = {"Linear": Linear, "DecodeLayer": DecodeLayer,
                                               "DecodeModel": DecodeModel}
# A linear's weight format code (Linear.format, the GEMMs' `format` argument) by weight dtype.
WEIGHT_FORMATS: dict[torch.dtype, int] = {torch.float32: header_abi().constants["WEIGHT_F32"],
                                          torch.int8: header_abi().constants["WEIGHT_I8"],
                                          torch.bfloat16: header_abi().constants["WEIGHT_BF16"]}


def layout_problems(library: KernelLibrary, abi: HeaderAbi | None = None,
                    mirrors: dict[str, type[ctypes.Structure]] | None = None) -> list[str]:
    """How the ctypes mirrors differ from the compiled structs (sizes, field offsets), and declared
    structs or fields with no mirror or no row in csrc/abi_layout.c; empty when they agree."""
    abi, mirrors = abi or header_abi(), MIRRORS if mirrors is None else mirrors
    problems = [f"struct {name} is declared in {HEADER.name} but has no ctypes mirror"
                for name in abi.structs if name not in mirrors]
    for name, mirror in mirrors.items():
        compiled = library.kernel_abi_struct_size(name.encode())
        if compiled != ctypes.sizeof(mirror):
            problems.append(f"sizeof({name}): {compiled} compiled, {ctypes.sizeof(mirror)} in the ctypes mirror")
        mirrored = {field[0] for field in mirror._fields_}
        for field in abi.structs.get(name, ()):
            if field.name not in mirrored:
                problems.append(f"{name}.{field.name} is declared in {HEADER.name} but not in the ctypes mirror")
                continue
            key, described = (name.encode(), field.name.encode()), getattr(mirror, field.name)
            offset, size = library.kernel_abi_field_offset(*key), library.kernel_abi_field_size(*key)
            if offset < 0:
                problems.append(f"{name}.{field.name} has no row in csrc/abi_layout.c")
                continue
            if offset != described.offset:
                problems.append(f"offsetof({name}, {field.name}): {offset} compiled, {described.offset} in the mirror")
            if size != described.size:
                problems.append(f"sizeof({name}.{field.name}): {size} compiled, {described.size} in the mirror")
    return problems


class KernelLibrary:
    """The compiled kernels library with every declared function bound as an attribute of its name.
    Loading raises KernelAbiError when one is missing or a struct's layout differs (OSError when
    the file cannot load)."""

    def __init__(self, path: Path, abi: HeaderAbi | None = None) -> None:
        abi = abi or header_abi()
        self.path = path
        self.cdll = ctypes.CDLL(str(path))
        for name in abi.functions:
            setattr(self, name, bind(self.cdll, name, abi))
        problems = layout_problems(self, abi)
        if problems:
            raise KernelAbiError("the shared structs do not match the compiled ones: " + "; ".join(problems))

    def __getattr__(self, name: str) -> Any:
        """Only reached for a name the header does not declare."""
        raise AttributeError(f"{HEADER.name} declares no function {name}")
