"""Text a student's code runs (`exec`, `eval`, `compile`), decoded without running anything of theirs.

`literal` evaluates an expression's syntax tree from string and bytes literals, names bound to them
(`env`), `+`, `[::-1]`, `.encode()`/`.decode()`, `"".join([...])`, `compile(text, ...)`, and the decoders
of base64, binascii, codecs, zlib, gzip, bz2 and lzma (`DECODERS`), each output capped at MAX_TEXT
(a decompression bomb stops there); anything else is None. `dotted` names what an expression refers to
through the notebook's imports. Used by `dlo.harness.authored` for the similarity report.
"""

from __future__ import annotations

import ast
import base64
import binascii
import bz2
import codecs
import lzma
import zlib

MAX_TEXT = 4 << 20  # characters or bytes of one decoded value


def _bounded(decompressor, data: bytes) -> bytes:
    """Decompressed up to MAX_TEXT; ValueError when there is more (a bomb is never held in memory)."""
    out = decompressor.decompress(data, MAX_TEXT)
    if not decompressor.eof or getattr(decompressor, "unconsumed_tail", b""):
        raise ValueError("decompressed text too large or cut")
    return out


def _zlib(data: bytes, wbits: int = 15) -> bytes:
    return _bounded(zlib.decompressobj(wbits), data)


DECODERS = {
    "base64.b64decode": base64.b64decode, "base64.standard_b64decode": base64.standard_b64decode,
    "base64.urlsafe_b64decode": base64.urlsafe_b64decode, "base64.b32decode": base64.b32decode,
    "base64.b16decode": base64.b16decode, "base64.b85decode": base64.b85decode, "base64.a85decode": base64.a85decode,
    "base64.decodebytes": base64.decodebytes, "binascii.a2b_base64": binascii.a2b_base64,
    "binascii.unhexlify": binascii.unhexlify, "binascii.a2b_hex": binascii.a2b_hex, "bytes.fromhex": bytes.fromhex,
    "zlib.decompress": _zlib, "gzip.decompress": lambda d: _zlib(d, 31),
    "bz2.decompress": lambda d: _bounded(bz2.BZ2Decompressor(), d),
    "lzma.decompress": lambda d: _bounded(lzma.LZMADecompressor(), d),
}
CODECS = {"rot13": "rot13", "rot_13": "rot13", "base64": "base64", "hex": "hex", "zlib": "zlib", "bz2": "bz2",
          "utf-8": "utf-8", "utf8": "utf-8", "latin-1": "latin-1", "ascii": "ascii"}


def dotted(node, aliases: dict) -> str | None:
    """`a.b.c` for a name or attribute chain, its first name replaced by what the notebook bound it to
    (`import dlo.optim.reference as r`: r.adamw_step -> dlo.optim.reference.adamw_step)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call) and dotted(node.func, aliases) in ("inspect.unwrap", "getattr") and node.args:
        base = dotted(node.args[0], aliases)  # inspect.unwrap(x) is x's code; getattr(x, "name") is x.name
        attr = node.args[1] if len(node.args) >= 2 else None
        if base and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
            return f"{base}.{attr.value}"
        return base
    return None


def literal(node, env: dict, aliases: dict, what: list):
    """The str or bytes `node` evaluates to from literals and the decoders above, or None; `what`
    collects the decoders used."""
    try:
        value = _literal(node, env, aliases, what)
    except (ValueError, TypeError, binascii.Error, zlib.error, OSError, EOFError, lzma.LZMAError, LookupError,
            RecursionError, UnicodeError):
        return None
    return value if isinstance(value, (str, bytes)) and len(value) <= MAX_TEXT else None


def _literal(node, env, aliases, what):
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        return node.value
    if isinstance(node, ast.Name):
        return env.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _literal(node.left, env, aliases, what), _literal(node.right, env, aliases, what)
        return a + b if type(a) is type(b) and a is not None and len(a) + len(b) <= MAX_TEXT else None
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and node.slice.lower is None \
            and node.slice.upper is None and isinstance(node.slice.step, ast.UnaryOp):
        value = _literal(node.value, env, aliases, what)
        return value[::-1] if value is not None and ast.unparse(node.slice.step) == "-1" else None
    if not isinstance(node, ast.Call):
        return None
    args = [_literal(a, env, aliases, what) for a in node.args[:2]]
    name = dotted(node.func, aliases)
    if name in ("compile", "builtins.compile"):
        return args[0] if args else None  # exec(compile(text, ...)) runs text
    if name in DECODERS and args and args[0] is not None:
        what.append(name.split(".")[0])
        data = args[0].encode() if isinstance(args[0], str) else args[0]
        return DECODERS[name](data)
    if name == "codecs.decode" and args and args[0] is not None:
        codec = CODECS.get(str(args[1] if len(args) > 1 else "utf-8").lower())
        if codec in ("zlib", "bz2"):
            return DECODERS[f"{codec}.decompress"](args[0])
        what.append(codec or "codecs")
        return codecs.decode(args[0], codec) if codec else None
    if isinstance(node.func, ast.Attribute) and node.func.attr in ("decode", "encode", "join"):
        base = _literal(node.func.value, env, aliases, what)
        if node.func.attr == "decode" and isinstance(base, bytes):
            return base.decode("utf-8", "replace")
        if node.func.attr == "encode" and isinstance(base, str):
            return base.encode("utf-8", "replace")
        if node.func.attr == "join" and isinstance(base, str) and node.args and \
                isinstance(node.args[0], (ast.List, ast.Tuple)):
            items = [_literal(e, env, aliases, what) for e in node.args[0].elts]
            return base.join(items) if all(isinstance(i, str) for i in items) else None
    return None
