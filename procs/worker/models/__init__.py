"""The model registry: `ARCHITECTURES` maps each architecture name a config.json may give
(`architectures[0]`) to the class that runs it, an `Architecture` whose models are `CausalLM`s
(`procs.worker.models.base`). It is the one list of supported architectures; the worker's loader
refuses the others. A new architecture is its model file and its line here.
"""

from __future__ import annotations

from typing import Any

from batchserve.procs.worker.models.base import Architecture
from batchserve.procs.worker.models.bert import (
    BertForSequenceClassification,
    BertModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from batchserve.procs.worker.models.gemma import Gemma2Model, Gemma3Model, Gemma3TextOfMultimodal
from batchserve.procs.worker.models.gpt_oss import GptOssModel
from batchserve.procs.worker.models.llama import LlamaModel
from batchserve.procs.worker.models.mistral import MistralModel
from batchserve.procs.worker.models.mixtral import MixtralModel
from batchserve.procs.worker.models.olmoe import OlmoeModel
from batchserve.procs.worker.models.phi3 import Phi3Model
from batchserve.procs.worker.models.qwen2 import Qwen2Model
from batchserve.procs.worker.models.qwen3 import Qwen3Model
from batchserve.procs.worker.models.qwen3_next import Qwen3_5Model, Qwen3_5MoeModel, Qwen3NextModel
from batchserve.procs.worker.models.qwen_moe import Qwen2MoeModel, Qwen3MoeModel
from batchserve.shared.model import ModelLoadError

# Any: each class reads and takes its own config class (LlamaConfig, BertConfig, ...), a type the registry
# cannot name for all of them; the loader hands a class's from_tensors what its own config_from_hf read.
ARCHITECTURES: dict[str, Architecture[Any]] = {
    "LlamaForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": Qwen2Model,
    "Qwen3ForCausalLM": Qwen3Model,
    "MistralForCausalLM": MistralModel,
    "MixtralForCausalLM": MixtralModel,
    "Qwen2MoeForCausalLM": Qwen2MoeModel,
    "Qwen3MoeForCausalLM": Qwen3MoeModel,
    "OlmoeForCausalLM": OlmoeModel,
    "Phi3ForCausalLM": Phi3Model,
    "Gemma2ForCausalLM": Gemma2Model,
    "Gemma3ForCausalLM": Gemma3Model,
    "Gemma3ForConditionalGeneration": Gemma3TextOfMultimodal,
    "GptOssForCausalLM": GptOssModel,
    "Qwen3NextForCausalLM": Qwen3NextModel,
    "Qwen3_5ForCausalLM": Qwen3_5Model,
    "Qwen3_5ForConditionalGeneration": Qwen3_5Model,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeModel,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeModel,
    # decoders saved without their LM head: the pooling runner's (`shared.pooling.HEADLESS_ARCHITECTURES`)
    "LlamaModel": LlamaModel,
    "MistralModel": MistralModel,
    "Qwen2Model": Qwen2Model,
    "Qwen3Model": Qwen3Model,
    # encoders (`shared.pooling.ENCODER_ARCHITECTURES`): the pooling runner's too
    "BertModel": BertModel,
    "XLMRobertaModel": XLMRobertaModel,
    "RobertaModel": XLMRobertaModel,
    # cross-encoders (`shared.pooling.CROSS_ENCODER_ARCHITECTURES`)
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "RobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


def model_class(architecture: str) -> Architecture[Any]:
    """The class that runs `architecture`; ModelLoadError naming the supported ones if there is none."""
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"unsupported architecture {architecture or '(none)'}; supported: {', '.join(ARCHITECTURES)}"
        )
    return cls


__all__ = ["ARCHITECTURES", "model_class"]
