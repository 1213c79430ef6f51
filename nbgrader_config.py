"""nbgrader configuration for the DLO course.

Instructor notebooks live in solutions/<day>/<day>.ipynb (nbgrader's "source"), and the student
notebooks `dlo release` generates go to course/<day>/<day>.ipynb (nbgrader's "release").
`dlo grade` builds its own course root under --out with its own config (test cells run outside the
student's kernel by dlo.harness.execute.ResilientExecute, the kernel under bubblewrap, feedback
without hidden tests), so this file only serves `dlo release`/`dlo check` and instructors who call
nbgrader directly: a plain `nbgrader autograde` runs the test cells in the student's kernel, where
the student's code can change what they do. Grade with `dlo grade`.
"""

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.root = "."
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "course"
c.CourseDirectory.db_url = "sqlite:///gradebook.db"
# Notebook cells run for minutes on the full profile: nbgrader's 30 s default is far too small.
c.Execute.timeout = 1800
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
