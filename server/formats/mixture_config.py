"""The config model of `format: mixture` (server/order/mixture.py, formats/mixture.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from .config_base import DatasetBase, Strict

Weight = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _weight_alone(v: Any) -> Any:
    return {"weight": v} if isinstance(v, int | float) and not isinstance(v, bool) else v


class MixtureComponent(Strict):
    """One component: its weight, and renames that give its fields the mixture's names.

    Attributes:
        weight: >= 0, under a component given as a mapping.
        fields: Under a component: mixture's field name -> the component's field name (renames);
            after renaming, every component must give the same fields with the same dtypes and
            shapes, or the server does not start, naming the fields of each.
    """

    weight: Weight
    # mixture's field name -> this component's field name, e.g. {input_ids: tokens}.
    fields: dict[str, str] = Field(default_factory=dict)


class MixtureStep(Strict):
    """From global sample `from_sample` on (epoch * samples_per_epoch + position, counted
    from the run's first sample), these weights; a component not named gets 0.

    Attributes:
        from_sample: >= 1; the global sample (`epoch x samples_per_epoch + position`, from the run's
            first sample) from which the entry's weights hold, until the next entry.
        weights: Component name -> weight (>= 0, at least one > 0); components not named get 0.
    """

    from_sample: int = Field(ge=1)
    weights: dict[str, Weight] = Field(min_length=1)


class MixtureDataset(DatasetBase):
    """Other datasets of this config, drawn with weights: which component and which of its
    samples fill each position is a function of (seed, epoch, position), see docs/mixtures.md.

    Attributes:
        format: `"mixture"`: selects this model (the key every dataset gives).
        components: Dataset name -> its weight (a number >= 0), or -> `{weight: W, fields: {...}}`;
            every name a dataset of this config that is not a mixture; at least one weight > 0;
            weights need not sum to 1 (they are normalised, then quantized to 2⁻²⁰).
        schedule: Weights from a global sample on, each entry `{from_sample, weights}`, in
            increasing `from_sample`.
        samples_per_epoch: >= 1; positions an epoch (the mixture's `num_samples`); independent of
            the weights, so a schedule does not change an epoch's length.
        on_error: As for any dataset, for the samples of every component read through this mixture
            (a replacement may come from any component); the components' own `on_error` applies to
            them when read on their own.
    """

    format: Literal["mixture"]
    # name -> weight, or {weight: w, fields: {common: own}}; weights need not sum to 1.
    components: dict[str, Annotated[MixtureComponent, BeforeValidator(_weight_alone)]] = Field(
        min_length=1)
    schedule: list[MixtureStep] = Field(default_factory=list)
    # Positions an epoch; default: the components' lengths summed (weights may change with
    # the schedule, an epoch's length must not).
    samples_per_epoch: int | None = Field(None, ge=1)
    # As for any dataset; inside a mixture the mixture's own policy applies to every component.
    on_error: Literal["raise", "skip"] = "raise"

    @model_validator(mode="after")
    def _phases(self) -> MixtureDataset:
        if not any(c.weight > 0 for c in self.components.values()):
            raise ValueError("components: at least one weight must be > 0")
        last = 0
        for n, step in enumerate(self.schedule):
            if step.from_sample <= last:
                raise ValueError(f"schedule.{n}.from_sample: must be larger than the one "
                                 f"before ({last}), got {step.from_sample}")
            last = step.from_sample
            unknown = sorted(set(step.weights) - set(self.components))
            if unknown:
                raise ValueError(f"schedule.{n}.weights: {', '.join(map(repr, unknown))} not in "
                                 f"components ({', '.join(self.components)})")
            if not any(w > 0 for w in step.weights.values()):
                raise ValueError(f"schedule.{n}.weights: at least one weight must be > 0")
        return self

    @property
    def draws_from(self) -> tuple[str, ...]:
        return tuple(self.components)

    def check_among(self, name: str, datasets: Mapping[str, DatasetBase]) -> None:
        """Every component is another dataset of the config, and not a mixture."""
        for c in self.components:
            if c not in datasets:
                raise ValueError(f"datasets.{name}.components: {c!r} is not a dataset of this "
                                 f"config; datasets: {', '.join(datasets)}")
            if isinstance(datasets[c], MixtureDataset):
                raise ValueError(f"datasets.{name}.components: {c!r} is a mixture; a mixture "
                                 "of mixtures is not supported: list its components here")

    def phase_weights(self) -> list[tuple[int, list[float]]]:
        """(first global sample, weight of each component in `components` order) per phase."""
        names = list(self.components)
        return [(0, [c.weight for c in self.components.values()])] + [
            (s.from_sample, [s.weights.get(n, 0.0) for n in names]) for s in self.schedule]
