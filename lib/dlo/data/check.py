"""What each day reads from `data_dir` (and Day 5 from `weights_dir`), checked in one place, and `dlo data`:

    dlo data check DIR [DAY ...] [--profile full|tiny] [--weights-dir W]   one line per day: ok, or FIX and the fix
    dlo data tokens CORPUS ... --tokenizer tokenizer.json --out DIR [--profile full|tiny] [--force]

A day's `dlo.registry.DaySpec.data` names what it reads ("cifar10", "tokens": `dlo.data.layout`);
`check_data` is `dlo.config.resolve`'s check (so `dlo.setup` in the notebook and `dlo run` before any
cell refuse a given but wrong data_dir in one line: never a silent fallback to synthetic data), the
lines are `dlo data check`'s and `dlo doctor --data-dir`'s. Nothing here downloads anything: compute
nodes are offline, a class prepares its folders on a login node (README: "Data and weights, offline").
"""

from __future__ import annotations

from pathlib import Path

from dlo.data.cifar import check_cifar10
from dlo.data.layout import KINDS, DataError
from dlo.data.tokens import check_tokens, make_tokens
from dlo.errors import BadInput
from dlo.registry import DAYS

Line = tuple[bool, str, str]  # (ok, topic, what was found or the fix): `dlo doctor`'s lines
LLAMA_DAY = "day5_fsdp"  # the day that reads tokens.npy and a checkpoint (weights_dir): its Llamas decide


def check_kind(kind: str, data_dir: str | Path, preset) -> str:
    """One kind of data a day reads, for the day's `preset` (Day 5's vocabulary and window): what is
    there, or DataError (one line: what is wrong and what to do)."""
    if kind == "cifar10":
        return check_cifar10(data_dir)
    if kind == "tokens":
        from dlo.experiments.day5_data import token_needs

        vocab, min_len, models = token_needs(preset)
        return check_tokens(data_dir, vocab, min_len, model=models)
    raise ValueError(f"unknown data kind {kind!r}; one of {', '.join(KINDS)}")


def check_data(run) -> None:
    """`dlo.config.resolve`'s check of a `Run`: everything its day reads from `run.data_dir` is there
    and fits its preset, else DataError (one line). No data_dir: synthetic data, nothing to check."""
    if run.data_dir is None or run.day not in DAYS:
        return
    for kind in DAYS[run.day].data:
        check_kind(kind, run.data_dir, run.preset)


def day_line(day: str, data_dir: Path, profile: str = "full") -> Line:
    """What `day` reads from `data_dir` at `profile`: ok and what is there, or FIX and the fix."""
    kinds = DAYS[day].data
    if not kinds:
        return True, day, "reads nothing from data_dir (its data are synthetic)"
    try:
        return True, day, "; ".join(check_kind(kind, data_dir, DAYS[day].presets[profile]) for kind in kinds)
    except DataError as exc:
        return False, day, str(exc)


def weights_line(weights_dir: Path, profile: str = "full") -> Line:
    """Day 5's checkpoint: config.json equal to P.model's config (Llama 3.2 3B at the full profile) and
    every tensor present with its shape, from the headers (no tensor read)."""
    from dlo.experiments.day5_data import llama_config
    from dlo.models.llama_hf import CheckpointError, check_checkpoint

    preset = DAYS[LLAMA_DAY].presets[profile]
    try:
        found = check_checkpoint(weights_dir, llama_config(preset), what=f"{preset.model}'s config")
    except CheckpointError as exc:
        return False, "weights", str(exc)
    files = {path for path, _, _ in found.values()}
    dtypes = sorted({dtype for _, _, dtype in found.values()})
    return True, "weights", (f"{weights_dir}: {preset.model} ({LLAMA_DAY}, {profile}): {len(found)} tensors in "
                             f"{len(files)} file(s), {'/'.join(dtypes)}; config and shapes match "
                             f"(-p weights_dir {weights_dir})")


def lines(data_dir: Path, days=None, profile: str = "full", weights_dir: Path | None = None) -> list[Line]:
    """`dlo data check`'s lines: one per day (default: every day), then the weights when given."""
    out = [day_line(day, data_dir, profile) for day in (days or list(DAYS))]
    return out + ([weights_line(weights_dir, profile)] if weights_dir is not None else [])


def summary(found: list[Line], data_dir: Path | None = None) -> Line:
    """The lines of `lines` as `dlo doctor`'s one "data" line: ok, or FIX with each problem once (the
    days that share it named together)."""
    problems: dict[str, list[str]] = {}
    for ok, topic, text in found:
        if not ok:
            problems.setdefault(text, []).append(topic)
    if problems:
        return False, "data", "; ".join(f"{', '.join(topics)}: {text}" for text, topics in problems.items())
    readers = [topic for _, topic, text in found if topic != "weights" and not text.startswith("reads nothing")]
    said = [f"{data_dir}: what {', '.join(readers)} read(s) is there" if readers else
            f"{data_dir}: {', '.join(t for _, t, _ in found if t != 'weights')} read(s) nothing from it"] \
        if data_dir is not None else []
    said += [text for _, topic, text in found if topic == "weights"]
    return True, "data", "; ".join(said) + (f" (-p data_dir {data_dir})" if readers else "")


def print_lines(found: list[Line]) -> int:
    """Print `ok`/`FIX` lines, aligned as `dlo doctor` prints them; 1 when one says FIX, else 0."""
    width = max(len(topic) for _, topic, _ in found)
    for ok, topic, text in found:
        print(f"{'ok ' if ok else 'FIX'}  {topic:<{width}}  {text}")
    return 0 if all(ok for ok, _, _ in found) else 1


def _known(days, profile: str) -> None:
    unknown = [d for d in days if d not in DAYS]
    if unknown:
        raise BadInput(f"unknown day(s) {', '.join(unknown)}; days: {', '.join(DAYS)}")
    if profile not in ("tiny", "full"):
        raise BadInput(f"unknown profile {profile!r}: tiny or full")


def check_main(data_dir: Path, days=(), profile: str = "full", weights_dir: Path | None = None) -> int:
    """`dlo data check`: BadInput (exit 2) for a folder that is not one or an unknown day, then the lines;
    exit status 1 when one says FIX."""
    _known(days, profile)
    for flag, folder in (("DIR", data_dir), ("--weights-dir", weights_dir)):
        if folder is not None and not Path(folder).is_dir():
            raise BadInput(f"{flag} {folder} is not a folder")
    return print_lines(lines(Path(data_dir), list(days), profile, weights_dir))


def tokens_main(sources, tokenizer: Path, out: Path, profile: str = "full", force: bool = False) -> int:
    """`dlo data tokens`: Day 5's tokens.npy from a local corpus, its ids checked against the vocabulary
    of Day 5's models at `profile`; any refusal is BadInput (exit 2), nothing written."""
    from dlo.experiments.day5_data import token_needs

    _known((), profile)
    vocab, min_len, models = token_needs(DAYS[LLAMA_DAY].presets[profile])
    try:
        print(make_tokens(sources, tokenizer, out, vocab, min_len, force=force, model=f"{models} (profile {profile})"))
    except DataError as exc:
        raise BadInput(str(exc)) from None
    return 0


__all__ = ["Line", "LLAMA_DAY", "check_data", "check_kind", "check_main", "day_line", "lines", "print_lines",
           "summary", "tokens_main", "weights_line"]
