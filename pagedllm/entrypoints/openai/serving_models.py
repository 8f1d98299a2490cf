"""Which models the server serves: the base model under its names, and the LoRA adapters (`--lora-modules`, POST
/v1/load_lora_adapter), each addressed by its name in a request's `model`, as vLLM's OpenAIServingModels."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """One `--lora-modules` item: `name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if value.lstrip().startswith("{"):
        try:
            d = json.loads(value)
            return LoRAModulePath(str(d["name"]), str(d["path"]), d.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"a JSON LoRA module needs \"name\" and \"path\": {value!r}") from e
    name, sep, path = value.partition("=")
    if not (sep and name and path):
        raise ValueError(f"a LoRA module is name=path or JSON, got {value!r}")
    return LoRAModulePath(name, path)


class LoRAModuleError(ValueError):
    """An adapter of --lora-modules that cannot load: start-up fails with this one line."""


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


class OpenAIServingModels:
    def __init__(self, engine: Any, served_model_names: str | list[str] | None = None,
                 lora_modules: list[LoRAModulePath] | None = None) -> None:
        """engine: an AsyncEngine (or a client with its interface). served_model_names: the base model's ids (the
        first is reported; default: the engine's model name)."""
        self.engine = engine
        names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names or [])
        self.base_model_names = names or [engine.model_name]
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}  # by name, in load order
        self._ids = itertools.count(1)  # never reused: an id names one load
        self._lock = asyncio.Lock()  # one load or unload at a time (a name is checked, then loaded)

    @property
    def model_name(self) -> str:
        return self.base_model_names[0]

    def is_base_model(self, model: str) -> bool:
        return model in self.base_model_names or model == self.engine.model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); a 404 for a name the server does not serve."""
        if model is None or self.is_base_model(model):
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise model_not_found(model)
        return lora

    def model_cards(self) -> list[ModelCard]:
        """The base model's ids, then the adapters (root: their path, parent: their base), as vLLM lists them."""
        max_len = self.engine.max_model_len
        cards = [ModelCard(id=n, root=self.engine.model_name, max_model_len=max_len) for n in self.base_model_names]
        return cards + [self._lora_card(lo) for lo in self.lora_requests.values()]

    def model_card(self, model: str) -> ModelCard:
        lora = self.lora_request(model)
        if lora is not None:
            return self._lora_card(lora)
        name = model if model in self.base_model_names else self.model_name
        return ModelCard(id=name, root=self.engine.model_name, max_model_len=self.engine.max_model_len)

    def _lora_card(self, lora: LoRARequest) -> ModelCard:
        return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or self.model_name,
                         max_model_len=self.engine.max_model_len)

    def _new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if self.is_base_model(name):
            raise OpenAIError(400, f"lora_name: {name!r} is the base model's name", param="lora_name",
                              code="invalid_value")
        if name in self.lora_requests:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                              code="invalid_value")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    # -- loading ------------------------------------------------------------------------------------------
    def init_static_loras(self) -> None:
        """Load the --lora-modules adapters, before the engine loop starts; LoRAModuleError for one that cannot."""
        for m in self.static_lora_modules:
            try:
                lora = self._new_request(m.name, m.path, m.base_model_name)
                self.engine.preload_lora(lora)
            except (OpenAIError, ValueError, OSError) as e:
                raise LoRAModuleError(f"cannot load LoRA adapter {m.name!r} from {m.path}: {e}") from None
            self.lora_requests[m.name] = lora
            logger.info("loaded LoRA adapter %r from %s", m.name, m.path)

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> str:
        self._check_enabled()
        async with self._lock:
            lora = self._new_request(req.lora_name, req.lora_path)
            try:
                await self.engine.add_lora(lora)
            except (ValueError, OSError) as e:  # InvalidModelError included: its message names file and fault
                raise OpenAIError(400, f"Cannot load LoRA adapter '{req.lora_name}': {e}", param="lora_path",
                                  code="invalid_value") from e
            self.lora_requests[lora.lora_name] = lora
        logger.info("loaded LoRA adapter %r from %s", lora.lora_name, lora.lora_path)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        self._check_enabled()
        if req.lora_name is None and req.lora_int_id is None:
            raise OpenAIError(400, "lora_name: give the adapter's lora_name (or lora_int_id)", param="lora_name",
                              code="invalid_value")
        async with self._lock:
            lora = next((lo for lo in self.lora_requests.values()
                         if req.lora_name in (None, lo.lora_name) and req.lora_int_id in (None, lo.lora_int_id)), None)
            if lora is None:
                what = f"'{req.lora_name}'" if req.lora_name is not None else f"with lora_int_id {req.lora_int_id}"
                raise OpenAIError(404, f"The lora adapter {what} cannot be found.", param="lora_name",
                                  code="model_not_found")
            del self.lora_requests[lora.lora_name]  # new requests cannot name it from here on
            await self.engine.remove_lora(lora.lora_name)  # its running requests finish with it
        logger.info("unloaded LoRA adapter %r", lora.lora_name)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."

    def _check_enabled(self) -> None:
        if not getattr(self.engine, "lora_enabled", False):
            raise OpenAIError(400, "LoRA is not enabled on this server: start it with --enable-lora",
                              code="lora_not_enabled")


def add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.load_lora_adapter(req))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.unload_lora_adapter(req))
