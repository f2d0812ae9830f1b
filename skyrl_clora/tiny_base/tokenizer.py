"""A small Qwen-style tokenizer built locally: byte-level BPE trained on the synthetic task's text.

* Pre-tokenization is Qwen2/3's regex (digits split one per token), then byte-level, so any text
  (real GSM8K included) round-trips; the vocabulary is a few hundred to ~1k tokens.
* Special tokens (Qwen's names): ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos). The
  tool tags ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` are single
  added tokens that are *not* special, as in Qwen3, so decoding with ``skip_special_tokens=True``
  keeps them and the environment can parse the call.
* The chat template is Qwen-style ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message,
  a "tool" message is rendered as a user turn wrapping the content in
  ``<tool_response>\\n...\\n</tool_response>`` (consecutive tool messages share one turn), and
  ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.

`episode_token_ids` and `observation_ids` reproduce, token for token, how SkyRL's `SkyRLGymGenerator`
(``use_conversation_multi_turn=True``) assembles a multi-turn episode, so pre-training sees exactly the
token sequences that RL later samples and trains on.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2/Qwen3's pre-tokenizer regex: words, single digits, punctuation runs, newlines, spaces.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

BASE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
)
"""SkyRLGymGenerator's fixed prefix for templating observations (see `observation_ids`)."""


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Trains the byte-level BPE on `corpus` and wraps it as a transformers fast tokenizer.

    Tool tags and special tokens are removed from the corpus before training (they are whole tokens).
    Ids 0..2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; the four tool tags come last.
    The vocabulary stops below `vocab_size` when the corpus has no more merges to offer.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def cleaned() -> Iterable[str]:
        for text in corpus:
            for token in SPECIAL_TOKENS + TOOL_TOKENS:
                text = text.replace(token, " ")
            yield text

    tokenizer.train_from_iterator(cleaned(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def template_ids(tokenizer: PreTrainedTokenizerFast, messages: Sequence[dict[str, str]],
                 add_generation_prompt: bool) -> list[int]:
    """Token ids of the chat template applied to `messages`, called exactly as SkyRL's generator calls it."""
    return list(tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    ))


def observation_ids(tokenizer: PreTrainedTokenizerFast, observations: Sequence[dict[str, str]],
                    is_done: bool) -> list[int]:
    """Token ids SkyRLGymGenerator appends after an assistant turn for `observations`.

    Templates ``BASE_CONVERSATION + observations`` (with the generation prompt unless the episode is
    done) and drops the base conversation's ids up to and including its last eos, so the result starts
    with the newline that follows the assistant's ``<|im_end|>``. Empty when there are no observations
    and the episode is done; just the generation prompt when there are none and it continues.
    """
    base_ids = template_ids(tokenizer, BASE_CONVERSATION, add_generation_prompt=False)
    eos_id = tokenizer.eos_token_id
    if eos_id in base_ids:
        base_ids = base_ids[: len(base_ids) - base_ids[::-1].index(eos_id)]
    if observations:
        full = template_ids(tokenizer, [*BASE_CONVERSATION, *observations], add_generation_prompt=not is_done)
        return full[len(base_ids):]
    if is_done:
        return []
    with_prompt = template_ids(tokenizer, BASE_CONVERSATION, add_generation_prompt=True)
    without_prompt = template_ids(tokenizer, BASE_CONVERSATION, add_generation_prompt=False)
    return with_prompt[len(without_prompt):]


def episode_token_ids(
    tokenizer: PreTrainedTokenizerFast,
    prompt: Sequence[dict[str, str]],
    turns: Sequence[tuple[str, Sequence[dict[str, str]]]],
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a multi-turn episode, assembled the way SkyRLGymGenerator does it.

    Args:
        prompt: the prompt messages (system, user).
        turns: per assistant turn, ``(assistant text without <|im_end|>, observation messages)``; the
            last turn's observations are ignored (the episode is done after it).

    Returns:
        ``(ids, mask)`` of equal length L: ``ids`` = prompt with generation prompt, then for each turn
        the encoded text + ``<|im_end|>`` (mask 1) followed by its observation ids (mask 0).
    """
    ids = template_ids(tokenizer, prompt, add_generation_prompt=True)
    mask = [0] * len(ids)
    for i, (text, observations) in enumerate(turns):
        done = i == len(turns) - 1
        turn = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        obs = [] if done else observation_ids(tokenizer, observations, is_done=False)
        ids += turn + obs
        mask += [1] * len(turn) + [0] * len(obs)
    return ids, mask
