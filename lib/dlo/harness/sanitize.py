"""What a student's notebook shows an instructor, made unable to run script: the autograded notebook
(what the formgrader renders), the feedback HTML (what `nbgrader release_feedback` hands out) and
anything rendered from them.

A graded notebook holds what the student's code displayed: `display(HTML("<script>..."))`, an
`<img onerror=...>`, `display(Javascript(...))`, an SVG with a script in it, a markdown cell with raw
HTML or a `javascript:` link. Rendered as they are, they run in the instructor's browser, from the
origin of JupyterLab and the formgrader, where a script can use Jupyter's API as the instructor.

So the autograded notebook is rewritten before anything renders it (`notebook`):
- outputs keep what shows no script: text/plain, PNG/JPEG/GIF images (checked to be base64), HTML
  rebuilt from an allow-list (`clean_html`: tags and attributes that cannot run script, links only to
  http(s)/mailto/#, images only from data: URIs), SVG shown as an image (`<img src="data:image/svg+xml...">`:
  a browser runs no script in an SVG loaded as an image), markdown and LaTeX when they render to safe
  HTML (else as plain text); `application/javascript`, widgets and every other type are dropped, with
  a note; output metadata keeps only an image's width and height (nbconvert writes them into the tag);
- a markdown or raw cell that is not the instructors' own (its source is not one of theirs) is kept when
  it renders to safe HTML, else shown as its text (every punctuation character escaped);
- cell tags, attachments and the notebook's metadata keep only values that cannot break out of the
  attribute or script block they are written into.

The feedback HTML gets a Content-Security-Policy (`lock_html`) that allows no script at all (MathJax
included: formulas show as TeX), in case a renderer ever lets something through.
"""

from __future__ import annotations

import base64
import binascii
import html
import re
from html.parser import HTMLParser

# Tags that show text, tables, lists and images and cannot run script.
TAGS = frozenset("""a abbr b blockquote br caption center code col colgroup dd del details div dl dt em h1 h2 h3 h4
h5 h6 hr i img ins kbd li ol p pre q s samp small span strike strong sub summary sup table tbody td tfoot th
thead tr tt u ul var wbr""".split())
VOID = frozenset({"br", "col", "hr", "img", "wbr"})
# Tags whose content is code or a document of its own: dropped with everything inside them.
DROPPED_WITH_CONTENT = frozenset("""applet embed frame frameset head iframe math noembed noframes noscript object
plaintext script select style svg template textarea title xmp""".split())
ATTRIBUTES = {"*": {"title", "lang", "dir", "class"}, "a": {"href"}, "img": {"src", "alt", "width", "height"},
              "td": {"colspan", "rowspan", "align"}, "th": {"colspan", "rowspan", "align"}, "table": {"border"},
              "ol": {"start"}, "col": {"span"}, "colgroup": {"span"}}
NUMBERS = frozenset({"width", "height", "colspan", "rowspan", "border", "start", "span"})
LINKS = ("http://", "https://", "mailto:", "#")
IMAGES = ("image/png", "image/jpeg", "image/gif")
BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")
# MathJax commands that make links, styles or ids (MathJax runs in the formgrader)
TEX_ACTIVE = re.compile(r"\\(href|url|style|class|cssId|html|unicode|require|data|attr|toggle|action)\b")
SAFE_WORD = re.compile(r"[\w.+#/ -]{0,100}")
OUTPUTS = ("display_data", "execute_result", "update_display_data", "stream", "error")
NOTE = "[output removed by the grader: {} can run script in the reader's browser]"
CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; font-src data:; base-uri 'none'; "
       "form-action 'none'")


# ----------------------------------------------------------------------------- HTML

class _Cleaner(HTMLParser):
    """HTML rebuilt from the allowed tags and attributes, every text and value escaped."""

    def __init__(self, ids: bool):
        super().__init__(convert_charrefs=True)
        self.ids, self.out, self.open, self.skip, self.removed = ids, [], [], [], []

    def handle_starttag(self, tag, attrs, closed=False):
        if self.skip:
            if tag in DROPPED_WITH_CONTENT and not closed:
                self.skip.append(tag)
            return
        if tag not in TAGS:
            self.removed.append(f"<{tag}>")
            if tag in DROPPED_WITH_CONTENT and not closed:
                self.skip.append(tag)
            return
        kept = []
        for name, value in attrs:
            if self._allowed(tag, name, value or ""):
                kept.append(f' {name}="{html.escape(value or "", quote=True)}"')
            else:
                self.removed.append(f"<{tag} {name}>")
        self.out.append(f"<{tag}{''.join(kept)}>")
        if tag not in VOID and not closed:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs, closed=True)
        if not self.skip and tag in TAGS and tag not in VOID:
            self.out.append(f"</{tag}>")

    def handle_endtag(self, tag):
        if self.skip:
            if tag == self.skip[-1]:
                self.skip.pop()
            return
        if tag in self.open:  # close what is open down to it: the output stays well nested
            while self.open:
                last = self.open.pop()
                self.out.append(f"</{last}>")
                if last == tag:
                    break

    def handle_data(self, data):
        if not self.skip:
            self.out.append(html.escape(data, quote=False))

    def handle_comment(self, data):
        self.removed.append("<!-- -->")

    def handle_decl(self, decl):
        pass  # a doctype: nothing to show

    def handle_pi(self, data):
        self.removed.append("<?...>")

    def unknown_decl(self, data):
        self.removed.append("<![...]>")

    def _allowed(self, tag: str, name: str, value: str) -> bool:
        if name not in ATTRIBUTES["*"] | ATTRIBUTES.get(tag, set()) and not (self.ids and name == "id"):
            return False
        if name in NUMBERS:
            return re.fullmatch(r"\d{1,5}%?", value.strip()) is not None
        if name == "href":
            return _squeezed(value).startswith(LINKS)
        if name == "src":
            return image_uri(value)
        return True

    def result(self) -> str:
        self.close()
        return "".join(self.out + [f"</{t}>" for t in reversed(self.open)])


def _squeezed(url: str) -> str:
    """A URL as a browser reads its scheme: spaces and control characters anywhere dropped, lower case."""
    return re.sub(r"[\x00-\x20\x7f]+", "", url).lower()


def image_uri(url: str) -> bool:
    """True for a data: URI of a PNG, JPEG, GIF or SVG image in base64 (an image shown by <img> runs nothing)."""
    head, _, data = url.strip().partition(",")
    return (head.lower() in {f"data:{t};base64" for t in (*IMAGES, "image/svg+xml")}
            and BASE64.fullmatch(data) is not None)


def clean_html(text: str, ids: bool = False) -> tuple[str, list[str]]:
    """(`text` rebuilt from allowed tags and attributes only, [what was removed]); `ids`: keep id attributes
    (markdown's heading anchors)."""
    cleaner = _Cleaner(ids)
    cleaner.feed(text)
    out = cleaner.result()
    return out, cleaner.removed


def svg_as_image(svg: str) -> str:
    """An <img> showing `svg`: loaded as an image, an SVG runs no script and loads nothing."""
    return f'<img src="data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()}">'


def is_base64(text: str) -> bool:
    try:
        base64.b64decode(re.sub(r"\s+", "", text), validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------- markdown and LaTeX

def markdown_is_safe(text: str) -> bool:
    """True when `text` renders (with nbconvert's own markdown) to HTML that `clean_html` leaves whole and
    holds no MathJax command that makes a link or a style."""
    from nbconvert.filters.markdown import markdown2html

    if TEX_ACTIVE.search(text):
        return False
    try:
        rendered = markdown2html(text)
    except Exception:  # noqa: BLE001 - markdown nbconvert cannot render: shown as text
        return False
    return not clean_html(rendered, ids=True)[1]


def as_text(markdown: str) -> str:
    """Markdown that shows `markdown` as written: every ASCII punctuation character backslash-escaped, so
    no tag, link, entity or formula can form."""
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", markdown)


# ----------------------------------------------------------------------------- a notebook

def output(out: dict) -> list[str]:
    """Make one output safe, in place; [mime types removed]. Its every field is the kernel's word, and
    the kernel ran the student's code: a field a template writes unescaped (a prompt number) is checked."""
    if out.get("output_type") == "execute_result" and type(out.get("execution_count")) is not int:
        out["execution_count"] = None
    if out.get("output_type") == "stream":
        out["name"] = out.get("name") if out.get("name") in ("stdout", "stderr") else "stdout"
        return []  # text, escaped by every renderer
    if out.get("output_type") == "error":
        return []  # its traceback: text, escaped by every renderer
    data, kept, removed, shown = out.get("data") or {}, {}, [], None
    for mime, value in data.items():
        text = "".join(value) if isinstance(value, list) else value
        if not isinstance(text, str):
            removed.append(mime)
        elif mime == "text/plain":
            kept[mime] = text
        elif mime in IMAGES and is_base64(text):
            kept[mime] = text
        elif mime == "text/html":
            kept[mime], lost = clean_html(text)
            removed += [f"{mime} {x}" for x in dict.fromkeys(lost)]
        elif mime == "image/svg+xml":
            kept.setdefault("text/html", svg_as_image(text))  # the student's own HTML, if any, wins
        elif mime in ("text/markdown", "text/latex"):
            if markdown_is_safe(text if mime == "text/markdown" else f"${text}$"):
                kept[mime] = text
            else:
                shown = text  # its source, as text (the repr beside it says nothing)
                removed.append(mime)
        else:
            removed.append(mime)
    if shown is not None:
        kept["text/plain"] = shown
    if not kept:
        kept["text/plain"] = NOTE.format(", ".join(removed) or "an empty output")
    out["data"] = kept
    out["metadata"] = {m: {k: v for k, v in meta.items() if k in ("width", "height") and type(v) is int}
                       for m, meta in (out.get("metadata") or {}).items()
                       if m in IMAGES and isinstance(meta, dict)}
    return removed


def _word(value) -> str:
    text = str(value)
    return text if SAFE_WORD.fullmatch(text) else "?"


def _safe_value(value):
    """`value` (notebook or kernel metadata) with every string that is not a plain word dropped."""
    if isinstance(value, dict):
        return {k: v for k, v in ((k, _safe_value(v)) for k, v in value.items())
                if isinstance(k, str) and SAFE_WORD.fullmatch(k) and v is not None}
    if isinstance(value, (bool, int, float)):
        return value
    return value if isinstance(value, str) and SAFE_WORD.fullmatch(value) else None


def _cell_metadata(meta: dict) -> dict:
    out = {k: v for k, v in meta.items() if k in ("collapsed", "scrolled", "editable", "deletable") and type(v) is bool}
    if isinstance(meta.get("nbgrader"), dict):
        out["nbgrader"] = meta["nbgrader"]  # the instructors' (dlo.harness.restore put it back from the release)
    if isinstance(meta.get("tags"), list):
        out["tags"] = [t for t in meta["tags"] if isinstance(t, str) and re.fullmatch(r"[\w.-]{1,64}", t)]
    if isinstance(meta.get("jupyter"), dict):
        out["jupyter"] = {k: v for k, v in meta["jupyter"].items() if type(v) is bool and SAFE_WORD.fullmatch(k)}
    return out


def notebook(nb, trusted: set[str]) -> list[str]:
    """Make a notebook (nbformat 4, as a dict) safe to render, in place; what was removed, one line each.
    `trusted`: the sources of the instructors' markdown and raw cells, kept as they are."""
    removed = []
    nb["metadata"] = {k: _safe_value(v) for k, v in (nb.get("metadata") or {}).items()
                      if k in ("kernelspec", "language_info")}
    for i, cell in enumerate(nb.get("cells", [])):
        cell["metadata"] = _cell_metadata(cell.get("metadata") or {})
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        kind = cell.get("cell_type")
        if not re.fullmatch(r"[\w-]{1,64}", str(cell.get("id", "x"))):
            cell["id"] = f"cell-{i}"
        if kind == "code":
            if type(cell.get("execution_count")) is not int:
                cell["execution_count"] = None
            known = [o for o in cell.get("outputs", []) if o.get("output_type") in OUTPUTS]
            removed += [f"cell {i}: an output of type {_word(o.get('output_type'))}"
                        for o in cell.get("outputs", []) if o not in known]
            cell["outputs"] = known
            for out in known:
                removed += [f"cell {i}: {what}" for what in output(out)]
            continue
        if source in trusted:
            continue
        attachments = cell.pop("attachments", None) or {}
        kept = {name: {m: v for m, v in bundle.items() if m in IMAGES and isinstance(v, str) and is_base64(v)}
                for name, bundle in attachments.items() if isinstance(bundle, dict)}
        if any(kept.values()):
            cell["attachments"] = {n: b for n, b in kept.items() if b}
        if kind == "markdown" and not markdown_is_safe(source):
            cell["source"] = as_text(source)
            removed.append(f"cell {i}: markdown shown as text")
        elif kind == "raw":
            cell["source"], lost = clean_html(source)
            removed += [f"cell {i}: raw {x}" for x in dict.fromkeys(lost)]
    return removed


def lock_html(page: str) -> str:
    """`page` with a Content-Security-Policy that lets no script run, first thing in its <head>."""
    meta = f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
    m = re.search(r"<head\b[^>]*>", page, re.IGNORECASE)
    return page[:m.end()] + meta + page[m.end():] if m else meta + page
