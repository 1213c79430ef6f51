"""cloudpickle by value, with the student's file names and source lines kept for tracebacks.

A function defined in a notebook cell or a script reaches a rank (`dlo.distributed.launch`) or the
grader's sandboxed runner (`dlo.grading.jail_runner`) as a code object rebuilt by cloudpickle. From
cloudpickle 3.1.3 on, every rebuilt code object is called `<dynamic-code>`, so an error on a rank
read `File "<dynamic-code>", line 10, in step` with no source line; and even with the file name
kept, a notebook cell's "file" (`/tmp/ipykernel_<pid>/<hash>.py`) exists only in the kernel's memory.

`Pickler` below fixes both, whatever cloudpickle version pickles:
- every code object it writes carries its original file name, or for a notebook cell IPython's own
  label (`Cell In[5]`, as the notebook shows its own tracebacks);
- the source lines of those files travel with the payload and are put into `linecache` when it is
  loaded, so `traceback` prints the student's line on the other side;
- what `torch.compile` wrapped travels in place of its wrapper (whose compiler state no pickle takes).

Loading needs nothing special: `pickle.loads` / `cloudpickle.loads` (with `dlo` importable).

    blob = dlo.pickling.dumps(fn)            # in the notebook or script
    fn = cloudpickle.loads(blob)             # on the rank: tracebacks name "Cell In[5], line 4"
"""

from __future__ import annotations

import io
import linecache
import pickle
import types

import cloudpickle

__all__ = ["Pickler", "dumps", "install_sources"]


def _ipython_label(filename: str) -> str | None:
    """"Cell In[5]" for a notebook cell's file name in a running IPython, else None."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    fmt = getattr(getattr(shell, "compile", None), "format_code_name", None)
    label = fmt(filename) if fmt else None
    return f"{label[0]} {label[1]}" if label else None


def _code_with_filename(rebuild, args, filename):
    """Rebuild a code object with cloudpickle's own reducer, then give it back its file name
    (nested code objects, in co_consts, went through the same path and already have theirs)."""
    return rebuild(*args).replace(co_filename=filename)


def install_sources(sources: dict) -> None:
    """Make `linecache` (what `traceback` reads) know these files' lines. An entry with no
    modification time is never checked against the disk, as IPython does for its cells."""
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, list(lines), name)


def _unpack(value, _sources_installed):
    return value


class _Shipment:
    """The object being dumped, followed by the source lines of every file its code came from."""

    def __init__(self, value):
        self.value = value


class _SourcesMarker:
    """Pickled after the value, when every file name the value's code uses is known."""


_SOURCES = _SourcesMarker()


class Pickler(cloudpickle.Pickler):
    """A cloudpickle Pickler that keeps file names and ships source lines (see the module's doc).
    Subclasses that override `reducer_override` call `super().reducer_override(obj)` last."""

    def __init__(self, file, protocol=pickle.HIGHEST_PROTOCOL, **kwargs):
        super().__init__(file, protocol=protocol, **kwargs)
        self._sources: dict[str, list[str]] = {}

    def dump(self, obj):
        return super().dump(_Shipment(obj))

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            return self._reduce_code(obj)
        if type(obj) is _Shipment:
            return _unpack, (obj.value, _SOURCES)  # value first: its code fills self._sources
        if obj is _SOURCES:
            return install_sources, (dict(self._sources),)
        original = _compiled_original(obj)
        if original is not None:  # torch.compile's wrapper holds compiler state no pickle takes: send what it wraps
            return _itself, (original,)
        return super().reducer_override(obj)

    def _reduce_code(self, code: types.CodeType):
        rebuild, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
        # The lines travel even for a file on disk: the other side may not see it (a sandbox, a node).
        shown = _ipython_label(code.co_filename) or code.co_filename
        if shown not in self._sources:
            self._sources[shown] = linecache.getlines(code.co_filename)
        return _code_with_filename, (rebuild, args, shown)


def _compiled_original(obj):
    """What `torch.compile` wrapped, for its wrapper of a function or of a module, else None. The other side
    runs the plain code (the same values; it compiles again where it is told to)."""
    if isinstance(obj, types.FunctionType):
        return getattr(obj, "_torchdynamo_orig_callable", None)
    if type(obj).__name__ == "OptimizedModule" and type(obj).__module__.startswith("torch._dynamo"):
        return getattr(obj, "_orig_mod", None)
    return None


def _itself(obj):
    return obj


def dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) -> bytes:
    """`cloudpickle.dumps` with the student's file names and source lines kept."""
    buf = io.BytesIO()
    Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()
