"""Token-level prompts for document analysis: document chunks and answers are spliced in as
token ids, never decoded and encoded again; only the short template text is encoded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from producer.bulk.chunking import group_to_fit, item_cap

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class Templates:
    """Encodes the template pieces once per job. The header is encoded with the tokenizer's
    special tokens (a Llama BOS); everything after it without."""

    def __init__(self, tokenizer: Tokenizer, instruction: str, reduce_instruction: str) -> None:
        self.tokenizer = tokenizer
        self.instruction = instruction
        self.reduce_instruction = reduce_instruction
        self.footer = self._plain("\n\nAnswer:")
        self.reduce_header = self._special(f"{reduce_instruction}\n\nQuestion: {instruction}")
        self.reduce_footer = self._plain("\n\nCombined answer:")

    def chunk_prompt(self, chunk_ids: list[int], index: int, total: int) -> list[int]:
        """The instruction, which part of how many this is, the chunk's tokens, then "Answer:"."""
        header = self._special(f"{self.instruction}\n\nPart {index + 1} of {total} of the "
                               "document:\n\n")
        return header + list(chunk_ids) + self.footer

    def reduce_budget(self, context_tokens: int) -> int:
        """Tokens left for the answers in one reduce prompt of at most ``context_tokens``."""
        return context_tokens - len(self.reduce_header) - len(self.reduce_footer)

    def label_tokens(self, answers: int) -> int:
        """The longest label of ``answers`` answers in a reduce prompt, in tokens (a label's
        length varies with how the tokenizer splits its number)."""
        return max(len(self._label(i)) for i in range(answers))

    def answer_item(self, position: int, answer_ids: list[int], cap: int) -> list[int]:
        """One answer as it appears in a reduce prompt: a label, then its tokens, cut to ``cap``
        tokens in all (the label always kept)."""
        label = self._label(position)
        return label + list(answer_ids)[: max(0, cap - len(label))]

    def _label(self, position: int) -> list[int]:
        """The label of the answer at ``position`` in a reduce prompt."""
        return self._plain(f"\n\nPart {position + 1}:\n")

    def reduce_prompt(self, items: Iterable[list[int]]) -> list[int]:
        """The reduce instruction, the question, the labelled answers, then "Combined answer:"."""
        body = [t for item in items for t in item]
        return self.reduce_header + body + self.reduce_footer

    def _special(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def plan_reduce(templates: Templates, answers: list[list[int]],
                context_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Group this level's answers into reduce prompts that each fit ``context_tokens``.

    Returns the labelled answer items (one per answer, cut to fit) and the groups of item
    indexes. A group of one needs no request: the caller passes its answer on to the next
    level. ValueError when not even two short answers would fit.
    """
    budget = templates.reduce_budget(context_tokens)
    cap = item_cap(budget)
    items = [templates.answer_item(i, ids, cap) for i, ids in enumerate(answers)]
    if budget < 2 or any(len(item) > cap for item in items):
        raise ValueError(
            f"a reduce prompt of at most {context_tokens} tokens leaves no room for the answers: "
            "lower max_tokens or reduce_max_tokens"
        )
    return items, group_to_fit([len(x) for x in items], budget)
