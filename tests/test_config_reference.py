"""scripts/config_reference.py: the committed configuration reference matches the config classes."""

from pydantic import Field

from flowalign.config import Section, TrainConfig
from flowalign.trainers import TRAINERS, get_trainer
from tests.scripts import load_script

ref = load_script("config_reference")
TEXT = ref.render()


def test_committed_page_is_current():
    """Fails when a config class changed and docs/guide/configuration.md was not regenerated."""
    committed = ref.OUTPUT.read_text()
    assert committed == TEXT, "docs/guide/configuration.md is stale: run python scripts/config_reference.py"


def test_check_flag_reports_a_stale_page(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text(TEXT)
    assert ref.main(["--check", "--out", str(page)]) == 0
    page.write_text(TEXT.replace("| `seed` |", "| `seed_old` |", 1))
    assert ref.main(["--check", "--out", str(page)]) == 1
    assert "stale" in capsys.readouterr().err


def test_every_section_and_trainer_option_is_documented_with_a_meaning():
    text = TEXT
    for section in ("run", "model", "model.lora", "data", "eval"):
        assert f"\n## {section}\n" in text
    for name in TRAINERS:
        assert f"## trainer: `{name}`" in text
    for field in list(TrainConfig.model_fields["run"].annotation.model_fields) + ["rho", "kappa", "dpo_beta", "K"]:
        assert f"| `{field}` |" in text
    assert ref.missing_meanings() == [], "give these fields a #: comment or Field(description=...)"
    # an option of one trainer appears with its own default, not the shared one
    opsd = get_trainer("diffusion_opsd").Config
    assert f"| `group_size` | `int` (≥ 2, ≤ 1024) | `{opsd.model_fields['group_size'].default}` |" in text


def test_meaning_prefers_description_then_comment_of_the_declaring_class():
    class Base(Section):
        #: first line of meaning
        #: continued here
        a: int = Field(1, ge=0)
        b: str = Field("x", description="from the ``description``")

    class Child(Base):
        a: int = Field(2, ge=1)  # overridden without a comment: the base's comment still applies

    assert ref.meaning(Child, "a", "x") == "first line of meaning continued here"
    assert ref.meaning(Child, "b", "x") == "from the `description`"
    rows = ref.table(Child, "x")
    assert rows[2] == "| `a` | `int` (≥ 1) | `2` | first line of meaning continued here |"
