"""The one split of a task's documents: probes read the first, calibration the last."""

import pytest

from capsense.compress.capabilities import document_ids


def test_probe_and_calibration_documents_are_the_two_ends():
    assert document_ids(10, 3, "probe") == [0, 1, 2]
    assert document_ids(10, 3, "calibration") == [7, 8, 9]
    assert not set(document_ids(10, 4, "probe")) & set(document_ids(10, 6, "calibration"))


def test_more_documents_than_the_task_has_gives_them_all():
    assert document_ids(4, 9, "probe") == [0, 1, 2, 3]
    assert document_ids(4, 9, "calibration") == [0, 1, 2, 3]


def test_unknown_use_is_refused():
    with pytest.raises(ValueError, match="use must be one of"):
        document_ids(4, 2, "training")


def test_a_misspelt_task_is_an_error_not_literal_calibration_text():
    """``capsense_mathh`` used to become one calibration text reading "capsense_mathh"."""
    from conftest import make_char_tokenizer

    from capsense.compress.calibration import calibration_samples
    from capsense.errors import CapsenseError

    tok = make_char_tokenizer()
    with pytest.raises(CapsenseError, match=r"'capsense_mathh'.*did you mean capsense_math_problems\?"):
        calibration_samples("capsense_mathh", tok, 2)
    with pytest.raises(CapsenseError, match=r"did you mean math\?"):
        calibration_samples("mathh", tok, 2)
    samples, info = calibration_samples("some literal text,math", tok, 2)  # text and tasks still work
    assert [r["kind"] for r in info] == ["text", "task"] and len(samples) == 2
