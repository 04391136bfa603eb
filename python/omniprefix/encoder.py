"""The checkpoint's own processor and towers as the engine's encoder.

:class:`CheckpointEncoder` turns media into :class:`~omniprefix.Item` s and, when the engine
asks (only on an encoder-cache miss), runs them through the model's image processor or
feature extractor and its vision or audio tower, all from transformers on the CPU::

    encoder = CheckpointEncoder.from_dir("fixtures/tiny/omni_thinker")
    engine = omniprefix.Engine.from_dir("fixtures/tiny/omni_thinker")
    item = encoder.image(png_bytes)                  # fingerprinted content + layout, no tower run
    out = engine.generate(ids, [item], encoder=encoder, max_tokens=16)

* **What is fingerprinted.** An image's decoded RGB pixels (``uint8 [H, W, 3]``), an audio's
  waveform (``float32``, at the feature extractor's rate), each with a digest of the processor's
  settings in ``params``: a different resize or mel setting is a different item. The layout
  (patch grid, mel frames) follows from the processor's own rules (``smart_resize``, the hop
  length) without running it, so a request that hits the cache runs neither processor nor
  tower.
* **What the towers return.** Images: the merger's output and the DeepStack levels, as
  transformers' ``get_image_features``; audio: ``get_audio_features``'s last hidden state.
* **Bad media** raises :class:`MediaError` naming the item and why (not a data URL, an
  undecodable or truncated file, over the size limits, a wrong sample rate), before the engine
  sees the request, so nothing is cached.

Needs torch, transformers and pillow (``python/requirements-encoder.txt``; the fleet install has
them): they are imported by :meth:`CheckpointEncoder.from_dir`, not by ``import omniprefix``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import threading
import wave
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ._omniprefix import Item

__all__ = ["CheckpointEncoder", "MediaError", "decode_data_url"]

#: Default limits: an image of at most 16 megapixels decoded, media of at most 32 MiB encoded,
#: audio of at most 10 minutes.
MAX_IMAGE_PIXELS = 16 * 1024 * 1024
MAX_MEDIA_BYTES = 32 * 1024 * 1024
MAX_AUDIO_SECONDS = 600.0


class MediaError(ValueError):
    """Media that cannot become an item; the message names the item (``image 0``) and why."""


def decode_data_url(url: str, name: str, max_bytes: int = MAX_MEDIA_BYTES) -> tuple[str, bytes]:
    """``(mime type, bytes)`` of an RFC 2397 base64 data URL (``data:image/png;base64,...``).

    Remote URLs are refused: a thinker worker has no business fetching from the network on a
    client's behalf (and a fleet's workers may have no route out)."""
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:40] + "..." if isinstance(url, str) and len(url) > 40 else url
        raise MediaError(f"{name}: only data URLs (data:<mime>;base64,...) are accepted, got {shown!r}")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError(f"{name}: the data URL is not base64 (expected data:<mime>;base64,<data>)")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise MediaError(f"{name}: {len(payload) * 3 // 4} bytes encoded, over the limit of {max_bytes}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{name}: the data URL's base64 does not decode ({e})") from None
    return header[: -len(";base64")], data


def _digest(settings: dict[str, Any]) -> str:
    """A short digest of a processor's settings, for an item's ``params``."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class CheckpointEncoder:
    """A checkpoint's processor and towers as an ``encoder=`` callable; see the module doc.

    Thread-safe: the towers run one item at a time under a lock (torch uses its own threads).
    :attr:`calls` counts tower runs per modality, which is how the tests see the encoder cache.
    """

    def __init__(self, processor: Any, visual: Any, audio_tower: Any, *, max_image_pixels: int = MAX_IMAGE_PIXELS,
                 max_media_bytes: int = MAX_MEDIA_BYTES, max_audio_seconds: float = MAX_AUDIO_SECONDS):
        self.processor = processor
        self.visual = visual
        self.audio_tower = audio_tower
        self.max_image_pixels = max_image_pixels
        self.max_media_bytes = max_media_bytes
        self.max_audio_seconds = max_audio_seconds
        self.calls = {"image": 0, "audio": 0}
        self._lock = threading.Lock()
        ip = processor.image_processor
        self._image_params = {"image_processor": _digest(ip.to_dict())}
        fe = processor.feature_extractor
        self._audio_params = {"feature_extractor": _digest(fe.to_dict())}

    @classmethod
    def from_dir(cls, path: Union[str, Path], **limits: Any) -> CheckpointEncoder:
        """The processor (``AutoProcessor``) and the thinker's ``visual`` and ``audio_tower``
        of a Qwen3-Omni checkpoint folder, in float32 on the CPU. Only the towers' weights are
        read (``thinker.visual.*``, ``thinker.audio_tower.*``), not the text model's.
        ``limits``: ``max_image_pixels``, ``max_media_bytes``, ``max_audio_seconds``."""
        import torch
        from safetensors import safe_open
        from transformers import AutoConfig, AutoProcessor
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeAudioEncoder,
            Qwen3OmniMoeVisionEncoder,
        )

        path = Path(path)
        processor = AutoProcessor.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        thinker = getattr(config, "thinker_config", config)
        towers = {"thinker.visual.": Qwen3OmniMoeVisionEncoder._from_config(thinker.vision_config, dtype=torch.float32),
                  "thinker.audio_tower.": Qwen3OmniMoeAudioEncoder._from_config(thinker.audio_config, dtype=torch.float32)}
        states: dict[str, dict[str, Any]] = {prefix: {} for prefix in towers}
        for file in _weight_files(path):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    for prefix, state in states.items():
                        if name.startswith(prefix):
                            state[name[len(prefix):]] = f.get_tensor(name).to(torch.float32)
        for prefix, module in towers.items():
            missing, unexpected = module.load_state_dict(states[prefix], strict=False)
            # Non-persistent buffers (rotary inverse frequencies) are not in a checkpoint.
            missing = [m for m in missing if not m.endswith("inv_freq")]
            if missing or unexpected:
                raise ValueError(f"{path}: {prefix}* does not match the tower: missing {missing[:4]}, "
                                 f"unexpected {unexpected[:4]}")
            module.eval()
        return cls(processor, towers["thinker.visual."], towers["thinker.audio_tower."], **limits)

    # ------------------------------------------------------------------------------ media to items

    def image(self, image: Any, name: str = "image 0") -> Item:
        """An image item from encoded bytes (PNG, JPEG, ... as pillow reads), a PIL image or an
        ``uint8 [H, W, 3]`` array; its layout is the patch grid the image processor will make."""
        from PIL import Image

        if isinstance(image, (bytes, bytearray, memoryview)):
            if len(image) > self.max_media_bytes:
                raise MediaError(f"{name}: {len(image)} bytes, over the limit of {self.max_media_bytes}")
            try:
                with Image.open(io.BytesIO(image)) as img:
                    self._check_pixels(img.width, img.height, name)
                    img.load()
                    image = img.convert("RGB")
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                raise MediaError(f"{name}: not a readable image ({e})") from None
        if isinstance(image, Image.Image):
            self._check_pixels(image.width, image.height, name)
            pixels = np.asarray(image.convert("RGB"))
        else:
            pixels = np.asarray(image)
            if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
                raise MediaError(f"{name}: an image array must be uint8 [H, W, 3], got {pixels.dtype} {pixels.shape}")
            self._check_pixels(pixels.shape[1], pixels.shape[0], name)
        grid = self._image_grid(pixels.shape[0], pixels.shape[1], name)
        return Item("image", pixels, {"kind": "image", "grid_thw": grid}, params=self._image_params)

    def audio(self, waveform: Any, sampling_rate: int, name: str = "audio 0") -> Item:
        """An audio item from a mono waveform (float, any length the feature extractor takes)
        at the feature extractor's sampling rate; its layout is the mel frame count."""
        fe = self.processor.feature_extractor
        if sampling_rate != fe.sampling_rate:
            raise MediaError(f"{name}: sampled at {sampling_rate} Hz; this model's feature extractor takes "
                             f"{fe.sampling_rate} Hz (resample before sending)")
        wave_f32 = np.ascontiguousarray(np.asarray(waveform, dtype=np.float32))
        if wave_f32.ndim != 1:
            raise MediaError(f"{name}: audio must be mono (one channel), got shape {wave_f32.shape}")
        if not np.isfinite(wave_f32).all():
            raise MediaError(f"{name}: the waveform holds NaN or infinite samples")
        seconds = len(wave_f32) / sampling_rate
        if seconds > self.max_audio_seconds:
            raise MediaError(f"{name}: {seconds:.1f} s of audio, over the limit of {self.max_audio_seconds:.0f} s")
        if len(wave_f32) < fe.n_fft:
            raise MediaError(f"{name}: {len(wave_f32)} samples, shorter than one analysis window ({fe.n_fft})")
        # WhisperFeatureExtractor(padding=True): one mel frame per hop (the last STFT frame is dropped).
        frames = len(wave_f32) // fe.hop_length
        return Item("audio", wave_f32, {"kind": "audio", "mel_frames": frames}, params=self._audio_params)

    def from_data_url(self, url: str, modality: str, name: str) -> Item:
        """An item from a client's data URL: an image (any format pillow reads) or a WAV audio
        (16 or 32-bit PCM; stereo becomes the channels' mean)."""
        _mime, data = decode_data_url(url, name, self.max_media_bytes)
        if modality == "image":
            return self.image(data, name)
        if modality == "audio":
            waveform, rate = _read_wav(data, name)
            return self.audio(waveform, rate, name)
        raise MediaError(f"{name}: {modality} is not supported here (images and audio are)")

    # ------------------------------------------------------------------------------------ encoder

    def __call__(self, item: Item) -> Any:
        """The engine's ``encoder``: embeddings (audio) or ``(embeddings, deepstack)`` (image)."""
        import torch

        with self._lock, torch.inference_mode():
            if item.modality == "image":
                return self._encode_image(item)
            if item.modality == "audio":
                return self._encode_audio(item)
            raise MediaError(f"{item.modality} items have no encoder here")

    def _encode_image(self, item: Item) -> tuple[np.ndarray, list[np.ndarray]]:
        from PIL import Image

        import torch

        inputs = self.processor.image_processor(images=[Image.fromarray(np.asarray(item.content))], return_tensors="pt")
        grid = [int(v) for v in inputs["image_grid_thw"][0]]
        if grid != list(item.layout["grid_thw"]):
            raise MediaError(f"the image processor made grid {grid}, the item's layout says {item.layout['grid_thw']}")
        # As transformers' get_image_features: the merger's output and the DeepStack levels.
        out = self.visual(inputs["pixel_values"].to(torch.float32), grid_thw=inputs["image_grid_thw"])
        self.calls["image"] += 1
        return out.pooler_output.numpy(), [level.numpy() for level in out.deepstack_features]

    def _encode_audio(self, item: Item) -> np.ndarray:
        import torch

        fe = self.processor.feature_extractor
        inputs = fe([np.asarray(item.content)], sampling_rate=fe.sampling_rate, padding=True, truncation=False,
                    return_attention_mask=True, return_tensors="pt")
        mask = inputs["attention_mask"]
        lengths = mask.sum(-1)
        if int(lengths[0]) != item.layout["mel_frames"]:
            raise MediaError(f"the feature extractor made {int(lengths[0])} mel frames, the item's layout says "
                             f"{item.layout['mel_frames']}")
        # As transformers' get_audio_features: the unpadded frames, then the tower's last hidden state.
        features = inputs["input_features"].permute(0, 2, 1)[mask.bool()].permute(1, 0)
        out = self.audio_tower(features.to(torch.float32), feature_lens=lengths, return_dict=True)
        self.calls["audio"] += 1
        embeddings: np.ndarray = out.last_hidden_state.numpy()
        return embeddings

    # -------------------------------------------------------------------------------------- rules

    def _check_pixels(self, width: int, height: int, name: str) -> None:
        if width * height > self.max_image_pixels:
            raise MediaError(f"{name}: {width}x{height} pixels, over the limit of {self.max_image_pixels}")
        if width < 1 or height < 1:
            raise MediaError(f"{name}: an empty image ({width}x{height})")

    def _image_grid(self, height: int, width: int, name: str) -> list[int]:
        """``[1, h, w]`` patches, by the image processor's own ``smart_resize``."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        ip = self.processor.image_processor
        size = ip.size or {}
        min_pixels = size.get("shortest_edge", getattr(ip, "min_pixels", None))
        max_pixels = size.get("longest_edge", getattr(ip, "max_pixels", None))
        try:
            h, w = smart_resize(height, width, factor=ip.patch_size * ip.merge_size, min_pixels=min_pixels,
                                max_pixels=max_pixels)
        except ValueError as e:
            raise MediaError(f"{name}: {width}x{height} cannot be resized for this model ({e})") from None
        return [1, h // ip.patch_size, w // ip.patch_size]


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards an index names)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [path / "model.safetensors"]


def _read_wav(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """A WAV file's mono float32 waveform (channels averaged) and its sample rate."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            rate, channels, width, frames = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            raw = w.readframes(frames)
    except (wave.Error, EOFError) as e:
        raise MediaError(f"{name}: not a readable WAV file ({e})") from None
    if len(raw) != frames * channels * width:
        raise MediaError(f"{name}: the WAV file is truncated ({len(raw)} of {frames * channels * width} bytes)")
    dtypes: dict[int, type[np.signedinteger[Any]]] = {2: np.int16, 4: np.int32}
    if width not in dtypes:
        raise MediaError(f"{name}: {8 * width}-bit WAV samples are not supported (16 or 32-bit PCM are)")
    samples = np.frombuffer(raw, dtype=np.dtype(dtypes[width]).newbyteorder("<")).astype(np.float32)
    samples /= float(np.iinfo(dtypes[width]).max) + 1.0
    return samples.reshape(-1, channels).mean(axis=1), rate


def encoder_for(model_dir: Union[str, Path], **limits: Any) -> Optional[CheckpointEncoder]:
    """A :class:`CheckpointEncoder` when the checkpoint has towers and a processor, else ``None``
    (a text-only checkpoint needs none)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    thinker = config.get("thinker_config", config)
    if "vision_config" not in thinker and "audio_config" not in thinker:
        return None
    if not (model_dir / "processor_config.json").is_file() and not (model_dir / "preprocessor_config.json").is_file():
        return None
    return CheckpointEncoder.from_dir(model_dir, **limits)
