"""`course_version` hashes every checks file a graded cell depends on, re-exported siblings included."""

from dlo.harness.submissions import checks_modules


def test_a_days_checks_module_brings_the_siblings_it_re_exports():
    names = {p.name for p in checks_modules({"__init__", "day1", "day7"})}
    assert {"__init__.py", "day1.py", "day1_accum.py", "day1_training.py", "day7.py", "day7_layers.py", "day7_model.py",
            "day7_comms.py", "day7_shared.py", "day7_scale.py", "day7_sequence.py", "day7_volumes.py",
            "saved.py", "rank_count.py", "torch_source.py"} == names
    assert not checks_modules({"day99"})  # a day with no checks module
