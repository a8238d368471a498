"""GenEval's rules on hand-built detections: known answers for every tag."""

import numpy as np
import pytest

from rewards.geneval.rules import Detection, box_iou, judge, relative_position, select_objects


def det(label, score=0.95, box=(0, 0, 10, 10)):
    return Detection(label, score, box)


def colours_from(table):
    """A colour namer reading each detection's colour from ``table`` (keyed by box)."""
    return lambda cls, dets: [table[d.box] for d in dets]


NO_COLOURS = colours_from({})


def verdict(dets, meta, colours=NO_COLOURS):
    return judge(select_objects(dets, meta["tag"]), meta, colours)


SINGLE = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
TWO = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
COUNT3 = {"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]}
RED_CAR = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
DOG_LEFT_OF_CAT = {"tag": "position",
                   "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]}
ATTR = {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                          {"class": "bus", "count": 1, "color": "blue"}]}


def test_single_object_found_and_below_threshold():
    assert verdict([det("dog", 0.5)], SINGLE).correct
    missed = verdict([det("dog", 0.3)], SINGLE)  # the threshold is strict: 0.3 is not above 0.3
    assert not missed.correct and missed.partial == 0.0 and missed.checks == [("count", False)]


def test_two_object_needs_both_and_partial_is_the_share():
    assert verdict([det("dog"), det("cat", box=(20, 0, 30, 10))], TWO).correct
    half = verdict([det("dog")], TWO)
    assert not half.correct and half.partial == pytest.approx(0.5)


def test_counting_exact_off_by_one_and_stricter_threshold():
    boxes = [(i * 20, 0, i * 20 + 10, 10) for i in range(4)]
    three = [det("cup", 0.95, b) for b in boxes[:3]]
    assert verdict(three, COUNT3).correct
    two = verdict(three[:2], COUNT3)
    assert not two.correct and two.partial == pytest.approx(1 - 1 / 3)
    four = verdict(three + [det("cup", 0.95, boxes[3])], COUNT3)  # the exclude clause: four is too many
    assert not four.correct and ("exclude", False) in four.checks and four.partial == pytest.approx(1 - 1 / 3)
    # a third cup at 0.8 counts for other tags but not for counting (0.9)
    weak = three[:2] + [det("cup", 0.8, boxes[2])]
    assert not verdict(weak, COUNT3).correct
    assert len(select_objects(weak, "two_object")["cup"]) == 3


def test_partial_goes_negative_when_far_too_many_are_found():
    many = [det("dog", 0.95, (i * 20, 0, i * 20 + 10, 10)) for i in range(3)]
    assert verdict(many, SINGLE).partial == pytest.approx(1 - 2)  # the reference's 1 - |1 - 3| / 1
    assert verdict(many, SINGLE).correct  # GenEval's single_object has no exclude: extras pass


def test_colour_right_and_wrong():
    car = det("car")
    assert verdict([car], RED_CAR, colours_from({car.box: "red"})).correct
    wrong = verdict([car], RED_CAR, colours_from({car.box: "blue"}))
    assert not wrong.correct and wrong.partial == pytest.approx(0.5) and ("colour", False) in wrong.checks


def test_colour_attribution_needs_each_object_its_own_colour():
    car, bus = det("car", box=(0, 0, 10, 10)), det("bus", box=(20, 0, 30, 10))
    assert verdict([car, bus], ATTR, colours_from({car.box: "red", bus.box: "blue"})).correct
    swapped = verdict([car, bus], ATTR, colours_from({car.box: "blue", bus.box: "red"}))
    assert not swapped.correct and swapped.partial == pytest.approx(0.5)


def test_position_right_side_wrong_side_and_margin():
    cat = det("cat", box=(60, 0, 80, 20))
    assert verdict([cat, det("dog", box=(0, 0, 20, 20))], DOG_LEFT_OF_CAT).correct
    wrong = verdict([cat, det("dog", box=(100, 0, 120, 20))], DOG_LEFT_OF_CAT)
    # the reference credits the failed pair with 0 and then 1: terms (1, 1, 0, 1)
    assert not wrong.correct and wrong.partial == pytest.approx(0.75) and ("position", False) in wrong.checks
    # centres 5 px apart with 20 px boxes: inside the 0.1 × (20 + 20) margin, so no relation at all
    assert not verdict([cat, det("dog", box=(55, 0, 75, 20))], DOG_LEFT_OF_CAT).correct
    no_target = verdict([det("dog", box=(0, 0, 20, 20))], DOG_LEFT_OF_CAT)
    assert not no_target.correct and no_target.partial == pytest.approx(1 / 3)  # terms (0, 1, 0)


def test_relative_position_dominant_axis():
    assert relative_position((0, 0, 10, 10), (50, 0, 60, 10)) == {"left of"}
    assert relative_position((0, 50, 10, 60), (0, 0, 10, 10)) == {"below"}
    assert relative_position((0, 0, 10, 10), (50, 45, 60, 55)) == {"left of", "above"}
    assert relative_position((0, 0, 10, 10), (1, 1, 11, 11)) == set()


def test_excluded_class_present_fails():
    meta = {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "exclude": [{"class": "cat", "count": 1}]}
    assert verdict([det("dog")], meta).correct
    assert not verdict([det("dog"), det("cat", box=(20, 0, 30, 10))], meta).correct


def test_select_objects_orders_caps_and_nms():
    dets = [det("dog", s, (0, 0, 10, 10)) for s in (0.5, 0.9, 0.7)] + [det("dog", 0.6, (50, 50, 60, 60))]
    kept = select_objects(dets, "single_object")
    assert [d.score for d in kept["dog"]] == [0.9, 0.7, 0.6, 0.5]
    assert len(select_objects(dets, "single_object", max_objects=2)["dog"]) == 2
    assert [d.score for d in select_objects(dets, "single_object", nms_threshold=0.5)["dog"]] == [0.9, 0.6]
    assert box_iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0 and box_iou((0, 0, 9, 9), (20, 20, 29, 29)) == 0.0


def test_colours_are_asked_only_of_colour_clauses():
    asked = []

    def colours(cls, dets):
        asked.append(cls)
        return ["red"] * len(dets)

    judge(select_objects([det("dog")], "single_object"), SINGLE, colours)
    assert asked == []
    judge(select_objects([det("car")], "colors"), RED_CAR, colours)
    assert set(asked) == {"car"}


def test_detection_masks_are_optional():
    d = Detection("dog", 0.9, (0, 0, 2, 2), np.ones((4, 4), bool))
    assert verdict([d], SINGLE).correct
