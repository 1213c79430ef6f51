"""OUT/similarity.html: the similarity report (`dlo.harness.similarity`) as a page an instructor reads.

Each exercise's class spread and cutoffs first (how far apart independent solutions are, and what stands
out), then the listed pairs, flagged first, the two snippets side by side with the matching code
marked. Everything a student wrote is escaped: the page runs nothing of theirs.
"""

from __future__ import annotations

import html

from dlo.harness.winnowing import Code, K, W

MAX_SHOWN = 200
MAX_SNIPPET = 20000  # characters of a snippet shown (a pasted megabyte stays in the CSV only)
STYLE = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{padding:2px 8px;
border-bottom:1px solid #ddd;text-align:left}.pair{display:flex;gap:1em}.pair>div{flex:1;min-width:0}
pre{background:#f6f6f6;padding:.5em;overflow-x:auto;font-size:85%}mark{background:#ffd54f}h3{margin-top:2em}
.flag{color:#b00020}.plain{color:#555}"""


def _marked(code: Code, other: Code) -> str:
    """code.source, HTML-escaped, the tokens of its k-grams that occur in `other` (boilerplate aside) in <mark>."""
    hits = [False] * len(code.tokens)
    common = code.own & other.own
    for i, h in enumerate(code.grams):
        if h in common:
            hits[i:i + K] = [True] * K
    text, pos, out = code.source[:MAX_SNIPPET], 0, []
    i = 0
    while i < len(code.tokens):
        if not hits[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(code.tokens) and hits[j + 1]:
            j += 1
        start, end = code.tokens[i][1], code.tokens[j][2]
        if start >= len(text):
            break
        out += [html.escape(text[pos:start]), "<mark>", html.escape(text[start:end]), "</mark>"]
        pos, i = min(end, len(text)), j + 1
    out.append(html.escape(text[pos:]))
    return "".join(out) + ("\n... (cut)" if len(code.source) > MAX_SNIPPET else "")


def _references(names: list[str] | None) -> str:
    if names is None:
        return "not looked up: no submission has code of its own in this cell"
    if not names:
        return "none mapped: its checks name no dlo reference (compared with the students and the solution)"
    return html.escape(", ".join(names))


def _spread(cut: tuple) -> str:
    value, median, spread = cut
    if median is None:
        return f"class too small: flagged from {value:.2f}"
    told = " (cannot tell copying from solving here)" if value > 1 else ""
    return f"median {median:.2f}, spread {spread:.2f}: flagged from {value:.2f}{told}"


def _exercises(info: dict) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(d)}</td><td>{html.escape(c)}</td><td>{x['students']}</td>"
        + "".join(f"<td>{_spread(x['cutoffs'][k])}</td>" for k in ("student", "solution", "library"))
        + f"<td>{_references(x['refs'])}</td></tr>" for (d, c), x in sorted(info.items()))
    return ("<h2>Exercises: how far apart the class's solutions are</h2><table><tr><th>day</th><th>cell</th>"
            "<th>students</th><th>classmates</th><th>instructors' solution</th><th>library</th>"
            f"<th>library references</th></tr>{rows}</table>")


def page(rows: list[dict], snippets: dict, info: dict, submissions: int, rule: dict) -> str:
    """The page; `rule`: the report's numbers and words (Z, MIN_CLASS, NEAR, GAP, LISTED, CLONE, WITHIN,
    RESEMBLES, THRESHOLD, LIBRARY_COPIED), from `dlo.harness.similarity`."""
    e, r_ = html.escape, rule
    flagged = sum(r["flagged"] for r in rows)
    head = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Similarity</title><style>{STYLE}</style>"
            f"</head><body><h1>Similarity of the exercise cells</h1><p>{submissions} submission(s) compared: for "
            f"each exercise, the code each student wrote for it (its cell, the cells it uses, text it decodes and "
            f"runs) with every other student's, the instructors' solution and the library references of its "
            f"checks; winnowed fingerprints of {K} tokens (window {W}), names as one symbol, the released code "
            f"never counts; and the bytecode the checks ran. Flagged ({flagged}): what stands out from the class - "
            f"{r_['Z']:g} spreads above the class's median for that exercise and kind, or near-identical "
            f"(&ge; {r_['NEAR']}) where the median is more than {r_['GAP']} below; never under {r_['THRESHOLD']} "
            f"({r_['LIBRARY_COPIED']} with a library reference); with fewer than {r_['MIN_CLASS']} students, from "
            f"{r_['NEAR']} - and every {e(r_['CLONE'])} and every obfuscated code. Listed without a flag from "
            f"{r_['LISTED']}: {e(r_['WITHIN'])}, {e(r_['RESEMBLES'])}. "
            f"{len(rows)} listed, flagged first, then most similar first"
            f"{f', the first {MAX_SHOWN} shown (all in similarity.csv)' if len(rows) > MAX_SHOWN else ''}."
            f" A high score is a reason to read the two cells, not a verdict; it never changes a score.</p>")
    body = [head, _exercises(info), "<h2>Pairs</h2>"]
    if not rows:
        body.append("<p>No pair listed.</p>")
    for r in rows[:MAX_SHOWN]:
        cls = "flag" if r["flagged"] else "plain"
        title = (f"{e(r['day'])} / {e(r['cell'])}: {e(r['student'])}")
        if r["kind"] == "obfuscated":
            body.append(f"<h3 class='{cls}'>{e(r['match'])} &middot; {title}</h3>")
            continue
        a, b = snippets[(r["day"], r["cell"])][r["student"]], snippets[(r["day"], r["cell"])][r["other"]]
        other = {"student": r["other"], "solution": "the instructors' solution"}.get(r["kind"], f"library {r['other']}")
        obfuscated = f" <b class='flag'>(obfuscated: {e(r['obfuscated'])})</b>" if r["obfuscated"] else ""
        body.append(
            f"<h3 class='{cls}'>{r['similarity']:.2f} &middot; {e(r['match'])} &middot; {title} and {e(other)}</h3>"
            f"<p>{r['student_in_other']:.0%} of {e(r['student'])}'s fingerprints are in the other, "
            f"{r['other_in_student']:.0%} the other way ({r['fingerprints']} shared); bytecode {r['bytecode']:.0%} "
            f"alike; flagged from {r['cutoff']:.2f} here.{obfuscated}</p><div class='pair'>"
            f"<div><b>{e(r['student'])}</b><pre>{_marked(a, b)}</pre></div>"
            f"<div><b>{e(other)}</b><pre>{_marked(b, a)}</pre></div></div>")
    body.append("</body></html>\n")
    return "\n".join(body)
