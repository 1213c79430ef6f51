"""dlo.harness.feedback_html: the feedback page without nbconvert's second parse shows the same page, and its
templates are compiled once per warm process."""

import base64

import jinja2
import nbformat
from bs4 import BeautifulSoup
from nbconvert.exporters import HTMLExporter
from nbgrader.converters import GenerateFeedback

from dlo.harness import feedback_html

PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()
GRADES = {"notebook": "day", "score": 3.0, "max_score": 5.0, "late_penalty": 0.0}


def _notebook():
    code = nbformat.v4.new_code_cell("import math\nprint(math.pi)  # <b>not bold</b>")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="3.14159\n"),
                    nbformat.v4.new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"}),
                    nbformat.v4.new_output("display_data", data={"text/html": '<img src="x.png" alt="given">'})]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Day\nsome *text*, $x^2$"), code])
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    return nb


def _render(kind):
    return kind(config=GenerateFeedback().config).from_notebook_node(_notebook(), resources={"nbgrader": GRADES})[0]


def test_the_page_is_nbconverts_without_the_second_parse():
    ours, theirs = (BeautifulSoup(_render(k), "html.parser") for k in (feedback_html.FeedbackExporter, HTMLExporter))
    assert " ".join(ours.get_text().split()) == " ".join(theirs.get_text().split())
    assert [t.name for t in ours.find_all()] == [t.name for t in theirs.find_all()]
    alts = [img.get("alt") for img in ours.find_all("img")]
    assert alts == [img.get("alt") for img in theirs.find_all("img")] == [feedback_html.ALT, "given"]


def test_the_templates_are_compiled_once_per_process(monkeypatch):
    feedback_html.warm()  # as dlo grade's warm process does before forking the graders
    compiled = []
    real = jinja2.Environment.compile
    monkeypatch.setattr(jinja2.Environment, "compile", lambda env, *a, **k: compiled.append(a) or real(env, *a, **k))
    assert feedback_html.COMPILED.code and "<h4>day (Score: 3.0 / 5.0)</h4>" in _render(feedback_html.FeedbackExporter)
    assert compiled == []
