"""The exporter of `dlo grade`'s feedback pages: nbconvert's HTML exporter without its BeautifulSoup pass.

nbconvert's `HTMLExporter` renders the page, then parses it again with BeautifulSoup to give images
without one an alternative text and make the lab template's cells focusable (`tabindex`), and prints it
back: parse, selections and printing cost ~2.7 CPU s a page for the course's notebooks (their figures are
in the page), more than half of what a feedback page cost, once per graded submission. Here the alt text
is added on the rendered text; nbgrader's feedback template extends the classic one, which has none of
the lab's cell classes, so the focus edit had nothing to do. What the page shows, and that it runs no
script (`sanitize`), is unchanged.

Its templates' compiled code is kept in the process (`COMPILED`, a Jinja bytecode cache: ~0.7 CPU s a
page to compile them otherwise), and `warm()` renders one small page in `dlo grade`'s warm process
(`dlo.harness.warm`), so that each grader forked from it finds the templates compiled and pygments'
Python lexer built.
"""

from __future__ import annotations

import re

import jinja2
import nbformat
from nbconvert.exporters import HTMLExporter, TemplateExporter
from nbconvert.filters.highlight import Highlight2HTML
from nbconvert.filters.widgetsdatatypefilter import WidgetsDataTypeFilter

ALT = "No description has been provided for this image"  # nbconvert's own words
_IMG_WITHOUT_ALT = re.compile(r"<img\b(?![^>]*\salt=)", re.IGNORECASE)


def with_alt_text(page: str) -> str:
    """`page` with an alternative text on every image that has none."""
    return _IMG_WITHOUT_ALT.sub(f'<img alt="{ALT}"', page)


class _InProcess(jinja2.BytecodeCache):
    """Compiled templates kept in this process's memory (and in its forks'), checked against their source."""

    def __init__(self):
        self.code: dict[str, bytes] = {}

    def load_bytecode(self, bucket) -> None:
        if bucket.key in self.code:
            bucket.bytecode_from_string(self.code[bucket.key])  # ignored by Jinja when the source has changed

    def dump_bytecode(self, bucket) -> None:
        self.code[bucket.key] = bucket.bytecode_to_string()


COMPILED = _InProcess()


class FeedbackExporter(HTMLExporter):
    """`HTMLExporter` (its configuration, template and filters) whose page is not parsed again."""

    def _create_environment(self):
        environment = super()._create_environment()
        environment.bytecode_cache = COMPILED
        return environment

    def from_notebook_node(self, nb, resources=None, **kw):
        langinfo = nb.metadata.get("language_info", {})
        lexer = langinfo.get("pygments_lexer", langinfo.get("name", None))
        self.register_filter("highlight_code",
                             self.filters.get("highlight_code", Highlight2HTML(pygments_lexer=lexer, parent=self)))
        resources = self._init_resources(resources)
        self.register_filter("filter_data_type",
                             WidgetsDataTypeFilter(notebook_metadata=self._nb_metadata, parent=self,
                                                   resources=resources))
        page, resources = TemplateExporter.from_notebook_node(self, nb, resources, **kw)
        return with_alt_text(page), resources


def warm() -> None:
    """One small notebook rendered as nbgrader renders feedback (its template and configuration)."""
    from nbgrader.converters import GenerateFeedback

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# a title, $x^2$"),
                                         nbformat.v4.new_code_cell("import math\nprint(math.pi)  # one line")])
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    grades = {"notebook": "warm", "score": 0.0, "max_score": 0.0, "late_penalty": 0.0}  # what the template reads
    FeedbackExporter(config=GenerateFeedback().config).from_notebook_node(nb, resources={"nbgrader": grades})
