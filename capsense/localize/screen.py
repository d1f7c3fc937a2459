"""The collateral screen: heads whose knockout hurts a control beyond its noise are not handed on.

A head can hurt the target a lot *and* something else: early generic heads, or a head that
copies the target's tokens and also retrieves facts. Residualizing the target on the controls
(the selective ranking) lowers such a head's rank but does not exclude it, and a K-head set is
only checked as a whole, so a large target effect could buy a place in the chosen set at the
price of a capability nobody listed. The screen is absolute: whatever its target effect, a head
whose measured knockout damages any control by more than that control's threshold is set aside
(ranked after every clean head, flagged in ``heads.json`` and ``report.md``).

Noise: a control's single-head effects are mostly near zero, with a few heads that matter; the
robust spread of those effects over *every* head (1.4826 x the median absolute deviation around
the median) is the control's noise. Every head: the gradient methods measure alone only the heads
their estimate flags, a sample full of early generic heads whose spread is no noise level (on
SmolLM2 the 16 heads prior-guided measured alone put factual recall's "noise" at 19% and let
L2H2, +28% on facts, through); so where the run has attribution estimates of every head, their
spread is the noise, else the measured effects' (exhaustive: every head; cs: a regression's).
A head is collateral when its measured damage exceeds ``z`` noises above the median, and at least
``floor`` (relative): a control measured on few documents can have a tiny spread, and a 0.2%
change is no collateral damage whatever its z.
The default floor is the refine tolerance divided by the set size: K heads that each stay under
it cannot, by themselves, add up beyond what a chosen set may cost a control.

Controls scored by nats/token only (the screen reads the same damage measure the run ranks by).

**Controls until excluded** (round 42, :data:`SINGLE_CONTROLS`, ``LocateConfig.single_controls``): one control
beyond its threshold excludes a head whatever the others say, and with the attribution's estimates the
thresholds are known before any knockout, so a single's controls are scored cheapest first until one excludes
it (:mod:`capsense.localize.singles`). The same heads are set aside. On the SmolLM2 main job in float32 the screen set
aside 11 of 16 singles, ten after one or two of the cheapest controls and one after four, and chose the same set for 8.96
forward-equivalents instead of 17.25 (89 s against 150 s back to back; RESULTS-locate.md, round 42). What it gives
up: a set-aside head's other controls are not measured (``None`` in ``heads.json``, blank in the report), and its
worst control is the worst of those it was scored on.

**Cheapest first, the target among them** (round 45, ``cheapest-first``, the default): the exclusion never reads the
target, so the target takes its place among the controls by its token share, and a head a cheaper control excludes
is never scored on the target. On the main job all 11 set-aside heads were excluded before the target: 7.39
forward-equivalents instead of 8.96, the same heads set aside and the same set, every score both ways measured
identical (RESULTS-locate.md, round 45). What it gives up: those heads' target effects (blank; the selective fit
takes attribution's estimate there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_SCREEN_Z = 3.0
MIN_HEADS_FOR_NOISE = 5  # fewer heads measured alone: the noise is unknown and the floor decides
#: How a selective prior-guided run scores a single-head knockout: ``cheapest-first`` (the default since round 45):
#: the target and the controls in order of their token share, until a control is beyond its threshold, so a head that
#: a control cheaper than the target sets aside is never scored on the target; ``until-excluded`` (rounds 42-44): the
#: target first, then the controls cheapest first until one is beyond its threshold; ``all``: every probe (as runs
#: before round 42 did).
SINGLE_CONTROLS = ("cheapest-first", "until-excluded", "all")


@dataclass
class Screen:
    """Per control its noise and threshold; per head measured alone its worst control; the excluded heads."""

    z: float
    floor: float
    noise: dict[str, float]
    threshold: dict[str, float]
    worst: dict[int, tuple[str, float]] = field(default_factory=dict)  # head -> (control, relative damage)
    excluded: dict[int, tuple[str, float]] = field(default_factory=dict)  # head -> the control it hurts most beyond threshold
    until_excluded: bool = False  # a single's controls were scored until one excluded it (SINGLE_CONTROLS)
    target_after: bool = False  # ... the target in its place among them, after the cheaper ones (cheapest-first)

    def clean(self, ranking) -> list[int]:
        """``ranking`` without the excluded heads (order kept)."""
        return [int(h) for h in ranking if int(h) not in self.excluded]

    def as_dict(self, name) -> dict:
        return {
            "rule": f"a head measured alone is excluded when its damage to a control exceeds max({self.z:g} x the "
                    f"control's robust noise above its median, {self.floor:.4f}) (relative worsening)"
                    + (f"; {UNTIL_EXCLUDED}" if self.until_excluded else "")
                    + (f"; {TARGET_AFTER}" if self.target_after else ""),
            "z": self.z,
            "floor": round(self.floor, 6),
            "noise": {c: _r(v) for c, v in self.noise.items()},
            "threshold": {c: _r(v) for c, v in self.threshold.items()},
            "excluded": [{"head": name(h), "control": c, "damage": _r(d)} for h, (c, d) in
                         sorted(self.excluded.items(), key=lambda kv: -kv[1][1])],
        }


UNTIL_EXCLUDED = ("a single's controls are scored cheapest first until one is beyond its threshold: an excluded "
                  "head's other controls are not measured")
TARGET_AFTER = ("the target is scored in its place in that order, by its own token share: a head a cheaper control "
                "excluded has no target effect")


def _r(x: float) -> float | None:
    return None if not np.isfinite(x) else round(float(x), 6)


def collateral_screen(control_effects: dict[str, np.ndarray], z: float = DEFAULT_SCREEN_Z, floor: float = 0.0,
                      spread: dict[str, np.ndarray] | None = None, until_excluded: bool = False,
                      target_after: bool = False) -> Screen:
    """Screen heads by their measured control damage (per control: relative worsening per head,
    NaN where the head was not measured alone). ``spread``: per control, every head's estimated
    effect, to take the noise from (default: the measured effects). ``z`` = 0 turns the screen off.
    ``until_excluded``: the effects come from singles scored until a control excluded them, ``target_after``: with the
    target in its place among the controls cheapest first (both recorded, for the rule's text)."""
    noise, threshold, worst, excluded = {}, {}, {}, {}
    for c, eff in control_effects.items():
        eff = np.asarray(eff, dtype=float)
        ref = np.asarray(spread[c], dtype=float) if spread is not None and c in spread else eff
        seen = ref[np.isfinite(ref)]
        if len(seen) >= MIN_HEADS_FOR_NOISE:
            med = float(np.median(seen))
            noise[c] = 1.4826 * float(np.median(np.abs(seen - med)))
            threshold[c] = max(med + z * noise[c], floor)
        else:
            noise[c] = float("nan")
            threshold[c] = floor
        for h in np.flatnonzero(np.isfinite(eff)):
            h, d = int(h), float(eff[h])
            if h not in worst or d > worst[h][1]:
                worst[h] = (c, d)
            if z > 0 and d > threshold[c] and (h not in excluded or d - threshold[c] > excluded[h][1] - threshold[excluded[h][0]]):
                excluded[h] = (c, d)
    return Screen(z, floor, noise, threshold, worst, excluded, until_excluded, target_after)
