"""The options every model reward shares, and their one-line refusals."""

from __future__ import annotations

import pytest

from flowalign.errors import UserError
from rewards.aesthetic import AestheticScore
from rewards.clip_score import CLIPScore
from rewards.model_options import one_of
from rewards.preference import HPSScore, PickScore


def test_one_of_accepts_a_choice_and_names_every_choice_otherwise():
    one_of("x reward", "form", "b", ("a", "b"))
    with pytest.raises(UserError) as refused:
        one_of("x reward", "form", "c", {"a": 1, "b": 2}, {"b": "the former form"})
    assert str(refused.value) == "x reward: form='c' is not known; use one of a, b (the former form)"


@pytest.mark.parametrize("reward, choices", [
    (CLIPScore, "round (torchvision's CenterCrop), floor (CLIPImageProcessor's)"),
    (HPSScore, "round (torchvision's CenterCrop), floor (CLIPImageProcessor's)"),
    (PickScore, "floor (CLIPImageProcessor's), round (torchvision's CenterCrop)"),
    (AestheticScore, "floor (CLIPImageProcessor's), round (torchvision's CenterCrop)"),
])
def test_an_unknown_crop_offset_is_refused_before_any_weights_are_read(reward, choices):
    """Each reward lists its own default first; the refusal comes before the missing weights' line."""
    with pytest.raises(UserError, match=f"{reward.name} reward: crop_offset='centre' is not known; use one of "
                                        + choices.replace("(", r"\(").replace(")", r"\)")):
        reward(crop_offset="centre")
