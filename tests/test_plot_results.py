"""scripts/plot_results.py: the rows of docs/results.md's test-split table it plots."""

from pathlib import Path

from tests.scripts import load_script

TABLE = """# Results
## Former
| method | config | level (sampler) | base → tuned | seeds | training | paired W / L |
|---|---|---|---|---|---|---|
| Old | x | easy | 50.0 → 90.0 % | 1 | 5 min | 1 / 0 |

## On the test split

| method | config | level (sampler) | base → tuned | seeds | training | paired W / L |
|---|---|---|---|---|---|---|
| A | `a.yaml` | easy (20 steps) | 81.0 → 86.8 % (85.4-89.0) | 3 | 10 min each, 34-35 steps | 173 / 86 |
| B | `b.yaml` | medium (20 steps) | 23.0 → 22.7 % | 1 | 100 steps, 5.3-6.0 min each | 35 / 40 |
| C | `c.yaml` | easy (20 steps) | 81.0 → 71.9 % (59.4-84.0) | 3 | 10 CPU min each, 23-31 steps | 185 / 321 |
| D | `d.yaml` | easy (20 steps) | 81.0 → 80.0 % | 3 | 567 steps | 1 / 1 |

after the table
| E | `e.yaml` | easy | 1.0 → 2.0 % | 1 | 3 min | 0 / 0 |
"""


def test_reads_only_the_test_split_table_with_its_minutes():
    rows = load_script("plot_results").test_split_rows(TABLE)
    assert [r["method"] for r in rows] == ["A", "B", "C", "D"]
    a, b, c, d = rows
    assert (a["base"], a["mean"], a["lo"], a["hi"], a["minutes"]) == (81.0, 86.8, 85.4, 89.0, 10.0)
    assert (b["lo"], b["hi"]) == (22.7, 22.7) and abs(b["minutes"] - 5.65) < 1e-9  # a range: its midpoint
    assert c["minutes"] == 10.0 and d["minutes"] is None


def test_the_shipped_results_page_parses():
    rows = load_script("plot_results").test_split_rows((Path(__file__).parents[1] / "docs/results.md").read_text())
    assert len(rows) >= 17 and all(r["minutes"] for r in rows)
