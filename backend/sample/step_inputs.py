"""A sampler call's host inputs as one int32 array (floats as their bits), staged with the step's inputs or copied
alone, and viewed by name on the device (docs/architecture.md, "The engine step")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from tritium.backend.core.sequence import Sequence
from tritium.backend.sample.penalty_rows import PenaltyRows, PenaltyUpdate, is_penalized
from tritium.backend.sample.settings import ROW_SETTINGS, HostRowSettings, RowSettings


@dataclass
class HostSamplingInputs:
    """By name, lists of ints and of floats: the random rows and their settings, the rows asking for logprobs,
    the penalized rows (their slot in `PenaltyRows`, factors, and the tokens their slot lacks), the min_tokens
    bans; `update`: what the call writes into the penalty rows (packed as "fresh" and "update")."""

    settings: HostRowSettings
    update: PenaltyUpdate
    ints: dict[str, list[int]]
    floats: dict[str, list[float]]
    num_rows: int

    @property
    def logprob_rows(self) -> list[int]:
        return self.ints["logprob_rows"]

    @property
    def penalized(self) -> list[int]:
        return self.ints["penalized"]

    @property
    def every_row_penalized(self) -> bool:
        return len(self.penalized) == self.num_rows

    def uses(self, name: str) -> bool:
        """Whether a penalized row uses the `name` ("repetition", "presence", "frequency") penalty."""
        return any(v != (1.0 if name == "repetition" else 0.0) for v in self.floats[name])

    @classmethod
    def of(cls, seqs: list[Sequence], penalties: PenaltyRows, eos_token_ids: list[int],
           update: bool = True) -> HostSamplingInputs:
        """`update` False: the penalty rows as they are (a row sampled alone after its batch failed)."""
        settings = HostRowSettings.of(seqs)
        changes = penalties.update_for(seqs) if update else PenaltyUpdate([], [], [], [], {}, {})
        slots, counted = {**penalties.slot, **changes.taken}, {**penalties.counted, **changes.counted}
        penalized = [i for i, s in enumerate(seqs) if is_penalized(s)]
        extra_rows: list[int] = []
        extra_tokens: list[int] = []
        extra_outputs: list[int] = []
        for j, row in enumerate(penalized):
            s = seqs[row]
            start = min(counted.get(s.request_id, 0), s.num_tokens) if s.request_id in slots else 0
            tokens, outputs = penalties.tokens_after(s, start)
            extra_rows += [j] * len(tokens)
            extra_tokens += tokens
            extra_outputs += outputs
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for row, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:
                banned = [*s.params.stop_token_ids, *([] if s.params.ignore_eos else eos_token_ids)]
                ban_rows += [row] * len(banned)
                ban_tokens += banned
        ints = {"random_rows": settings.rows,
                "logprob_rows": [i for i, s in enumerate(seqs) if s.params.logprobs is not None],
                "penalized": penalized, "penalty_slots": [slots.get(seqs[r].request_id, 0) for r in penalized],
                "extra_rows": extra_rows, "extra_tokens": extra_tokens, "extra_outputs": extra_outputs,
                "ban_rows": ban_rows, "ban_tokens": ban_tokens,
                "fresh": changes.fresh, "update": changes.slots + changes.tokens + changes.outputs}
        floats: dict[str, list[float]] = {name: [getattr(seqs[r].params, f"{name}_penalty") for r in penalized]
                                          for name in ("repetition", "presence", "frequency")}
        for setting in ROW_SETTINGS:
            values = settings.values[setting.name]
            if setting.is_float:
                floats[setting.name] = [float(v) for v in values]
            else:
                ints[setting.name] = [int(v) for v in values]
        return cls(settings, changes, ints, floats, len(seqs))

    def packed(self) -> tuple[npt.NDArray[np.int32], dict[str, slice]]:
        """Every list one after the other, and where each is."""
        parts, where, start = [], {}, 0
        for name, values in self.ints.items():
            parts.append(np.asarray(values, dtype=np.int64).astype(np.int32))
            where[name], start = slice(start, start + len(values)), start + len(values)
        for name, floats in self.floats.items():
            parts.append(np.asarray(floats, dtype=np.float32).view(np.int32))
            where[name], start = slice(start, start + len(floats)), start + len(floats)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32), where


@dataclass
class SamplingInputs:
    """`HostSamplingInputs` on the device: `values` by name (int32, the floats' float32), and the random rows'
    settings (None when every row is greedy)."""

    host: HostSamplingInputs
    values: dict[str, torch.Tensor]
    settings: RowSettings | None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[name]

    def update_penalties(self, penalties: PenaltyRows) -> None:
        """Write this call's new tokens into `penalties`."""
        penalties.apply(self.host.update, self.values["fresh"], self.values["update"])

    @classmethod
    def view(cls, host: HostSamplingInputs, device_array: torch.Tensor, where: dict[str, slice]) -> SamplingInputs:
        """Views of `device_array`, which holds `host.packed()` at `where`."""
        values = {name: device_array[at] for name, at in where.items()}
        for name in host.floats:
            values[name] = values[name].view(torch.float32)
        settings = None
        if host.settings.rows:
            settings = RowSettings(host.settings.rows, values["random_rows"],
                                   {s.name: values[s.name] for s in ROW_SETTINGS}, host.settings.used)
        return cls(host, values, settings)

    @classmethod
    def on(cls, device: torch.device, host: HostSamplingInputs) -> SamplingInputs:
        """One copy of `host` to `device`, not waited for."""
        array, where = host.packed()
        return cls.view(host, torch.from_numpy(array).to(device, non_blocking=True), where)
