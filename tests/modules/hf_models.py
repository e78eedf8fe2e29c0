"""Small random (CPU FP8 GEMMs, torch._scaled_mm, are slow: keep them tiny) ``transformers`` causal LMs for the Hugging Face tests (built from configs; nothing downloaded)."""
import torch

VOCAB = 256


def tiny_llama(seed: int = 0, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
