"""What a graded notebook shows the instructor runs no script (issue 33): the sanitizer alone, in
milliseconds; tests/browser/test_feedback_scripts.py opens real feedback in Chromium."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output, new_raw_cell

from dlo.harness import sanitize as S

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(40)).decode()
SVG = '<svg xmlns="http://www.w3.org/2000/svg" onload="pwn()"><script>pwn()</script><circle r="4"/></svg>'
ATTACKS = [
    "<script>pwn()</script>",
    "<img src=x onerror=pwn()>",
    "<IMG SRC=x OnError=pwn()>",
    '<a href="java\tscript:pwn()">x</a>',
    '<a href="&#106;avascript:pwn()">x</a>',
    "<svg><script>pwn()</script></svg>",
    "<svg onload=pwn()>",
    "<iframe srcdoc='<script>pwn()</script>'></iframe>",
    "<style>@import 'x';</style><div style='background:url(javascript:pwn())'>x</div>",
    "<math><mtext></mtext><mglyph><svg><mtext><style><img src=x onerror=pwn()></style></mtext></svg></mglyph></math>",
    "<!--><img src=x onerror=pwn()>-->",
    '<img src="data:text/html;base64,PHNjcmlwdD4=">',
    '<img src="data:image/png;base64,AAAA" onerror="pwn()">',
    "<form action=javascript:pwn()><button>x</button></form>",
    "<meta http-equiv=refresh content='0;url=javascript:pwn()'>",
    "<object data='javascript:pwn()'></object><embed src=javascript:pwn()>",
    "<details open ontoggle=pwn()>",
    "<table><tr><td background=javascript:pwn()>x",
    "<<script>script>pwn()<</script>/script>",
    '<a href="x" onmouseover="pwn()">x</a>',
]
LIVE = re.compile(r"<\s*(script|iframe|object|embed|svg|math|form|meta|style)\b|\son\w+\s*=|javascript:|data:text",
                  re.IGNORECASE)


def test_html_outputs_lose_every_way_to_run_script_and_keep_the_rest():
    for attack in ATTACKS:
        cleaned, removed = S.clean_html(attack)
        assert not LIVE.search(cleaned), (attack, cleaned)
        assert removed, attack
    table = "<table border=1><tr><th colspan=2>loss</th></tr><tr><td>1.5 &lt; 2</td><td><b>ok</b></td></tr></table>"
    assert S.clean_html(table) == (table.replace("=1", '="1"').replace("=2", '="2"'), [])
    kept, _ = S.clean_html(f'<p>x</p><img src="data:image/png;base64,{PNG}" width="20"><a href="https://a.b/c">doc</a>')
    assert f'src="data:image/png;base64,{PNG}"' in kept and 'href="https://a.b/c"' in kept and "<p>x</p>" in kept
    assert S.clean_html("<div><b>unclosed")[0] == "<div><b>unclosed</b></div>"  # never swallows the page after it


class _Live(HTMLParser):
    """Where a rendered page could run pwn(): script bodies and attribute values (text is only shown)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found, self.in_script = [], False

    def handle_starttag(self, tag, attrs):
        self.in_script = tag == "script"
        self.found += [f"<{tag} {k}={v}>" for k, v in attrs if v and "pwn" in v]
        if tag == "img" and any(k == "src" and v and v.startswith("data:image/svg") for k, v in attrs):
            pass  # an SVG shown as an image runs nothing

    def handle_endtag(self, tag):
        self.in_script = False

    def handle_data(self, data):
        if self.in_script and "pwn" in data:
            self.found.append(f"<script>{data[:60]}")


def live_script(page: str) -> list[str]:
    finder = _Live()
    finder.feed(page)
    return finder.found


def _rendered(nb) -> str:
    """The notebook as the formgrader and the feedback render it (nbconvert's classic HTML template)."""
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="classic").from_notebook_node(nb)[0]


def _notebook():
    outputs = [
        new_output("display_data", data={"text/html": "<b>bold</b><script>pwn()</script>", "text/plain": "bold"}),
        new_output("display_data", data={"application/javascript": "pwn()", "text/plain": "<Javascript object>"}),
        new_output("display_data", data={"application/javascript": "pwn()"}),
        new_output("display_data", data={"image/svg+xml": SVG}),
        new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"},
                   metadata={"image/png": {"width": 20, "height": '1" onerror="pwn()'}}),
        new_output("display_data", data={"image/png": 'x" onerror="pwn()'}),
        new_output("display_data", data={"text/markdown": "[x](javascript:pwn())"}),
        new_output("display_data", data={"text/markdown": "**fine** | a < b"}),
        new_output("execute_result", data={"text/latex": r"$\href{javascript:pwn()}{x}$"}, execution_count=1),
        new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "x"}}),
        new_output("stream", name="stdout", text="<script>pwn()</script> printed\n"),
        new_output("error", ename="<img src=x onerror=pwn()>", evalue="<script>pwn()</script>",
                   traceback=["\x1b[31m<script>pwn()</script>\x1b[0m"]),
    ]
    invalid = [  # what a kernel that ran the student's code may send, schema or not
        {"output_type": "stream", "name": '"><script>pwn()</script>', "text": "x"},
        {"output_type": "execute_result", "execution_count": "<script>pwn()</script>", "data": {}, "metadata": {}},
        {"output_type": "<svg onload=pwn()>", "data": {"text/html": "<script>pwn()</script>"}},
    ]
    cells = [
        new_markdown_cell("# The instructors' text <img src='figure.png'>"),
        new_code_cell("display(...)", outputs=outputs, metadata={"tags": ['x" onmouseover="pwn()', "keep-me"]}),
        new_markdown_cell("My answer: <img src=x onerror=pwn()> and [a link](javascript:pwn())"),
        new_markdown_cell("My answer: **plain**, with a [doc link](https://pytorch.org) and $a < b$."),
        new_raw_cell("<script>pwn()</script>", metadata={"format": "text/html"}),
        new_markdown_cell("![i](attachment:a.svg)",
                          attachments={"a.svg": {"image/svg+xml": SVG}, "b.png": {"image/png": PNG}}),
    ]
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "widgets": {"application/vnd.jupyter.widget-state+json": {"state": "</script><script>pwn()</script>"}},
        "title": "</title><script>pwn()</script>"})
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    nb.cells[1].outputs += nbformat.from_dict(invalid)
    nb.cells[1].execution_count = "<script>pwn()</script>"
    return nb


@pytest.mark.filterwarnings("ignore:Your element with mimetype")  # the unsanitized notebook's widget
def test_a_notebook_keeps_text_and_images_and_loses_script():
    nb = _notebook()
    removed = S.notebook(nb, trusted={nb.cells[0].source})
    nbformat.validate(nb)
    raw = _notebook()  # the same notebook unsanitized (less what nbconvert refuses): the test sees what it looks for
    raw.cells[1].outputs, raw.cells[1].execution_count = raw.cells[1].outputs[:12], 1
    assert live_script(_rendered(raw))
    assert not live_script(_rendered(nb)), live_script(_rendered(nb))
    outs = nb.cells[1].outputs
    assert outs[0].data == {"text/html": "<b>bold</b>", "text/plain": "bold"}
    assert outs[1].data == {"text/plain": "<Javascript object>"}
    assert outs[2].data["text/plain"].startswith("[output removed by the grader: application/javascript")
    assert outs[3].data["text/html"].startswith('<img src="data:image/svg+xml;base64,')  # the SVG, as an image
    assert outs[4].data == {"image/png": PNG, "text/plain": "<Figure>"}
    assert outs[4].metadata == {"image/png": {"width": 20}}  # the height tried to break out of its attribute
    assert "image/png" not in outs[5].data
    assert outs[6].data == {"text/plain": "[x](javascript:pwn())"}  # shown, not a link
    assert outs[7].data == {"text/markdown": "**fine** | a < b"}  # safe markdown renders
    assert outs[8].data == {"text/plain": r"$\href{javascript:pwn()}{x}$"}
    assert list(outs[9].data) == ["text/plain"] and len(outs) == 14 and outs[12].name == "stdout"
    assert outs[13].execution_count is None and nb.cells[1].execution_count is None
    assert outs[10].text.startswith("<script>")  # a stream: escaped by every renderer
    assert nb.cells[1].metadata["tags"] == ["keep-me"]
    assert nb.cells[0].source == "# The instructors' text <img src='figure.png'>"  # trusted: untouched
    assert nb.cells[2].source.startswith(r"My answer\: \<img src\=x")  # shown as written, no tag
    assert nb.cells[3].source.startswith("My answer: **plain**")  # safe markdown kept as it is
    assert nb.cells[4].source == ""
    assert nb.cells[5].attachments == {"b.png": {"image/png": PNG}}
    assert set(nb.metadata) == {"kernelspec"}
    assert any("application/javascript" in r for r in removed) and any("markdown shown as text" in r for r in removed)


def test_escaped_markdown_renders_to_its_own_text():
    from nbconvert.filters.markdown import markdown2html

    source = "My <b>answer</b> [x](javascript:pwn()) &lt; $\\alpha$ `code` *em*"
    rendered = markdown2html(S.as_text(source))
    assert S.clean_html(rendered)[1] == [] and "javascript" not in re.sub(r"<[^>]+>", "", rendered).replace(
        "[x](javascript:pwn())", "")
    import html as h

    assert h.unescape(re.sub(r"<[^>]+>", "", rendered)).strip() == source


def test_the_feedback_page_allows_no_script():
    page = "<!DOCTYPE html>\n<html>\n<head>\n<meta charset='utf-8'>\n<script src='x.js'></script></head><body></body>"
    locked = S.lock_html(page)
    assert locked.index("Content-Security-Policy") < locked.index("<script")
    assert "script-src" not in S.CSP and "default-src 'none'" in S.CSP  # no script source at all
