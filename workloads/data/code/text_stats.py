import re
from collections import Counter

WORD = re.compile(r"[A-Za-z']+")


def word_counts(document: str) -> Counter:
    counts = Counter()
    for word in WORD.findall(document):
        counts[word.lower()] += 1
    return counts


def top_words(document: str, limit: int = 10) -> list[tuple[str, int]]:
    counts = word_counts(document)
    return counts.most_common(limit)


def average_word_length(document: str) -> float:
    words = WORD.findall(document)
    if not words:
        return 0.0
    return sum(len(word) for word in words) / len(words)


def sentence_lengths(document: str) -> list[int]:
    sentences = [part.strip() for part in re.split(r"[.!?]+", document)]
    return [len(WORD.findall(sentence)) for sentence in sentences if sentence]


def summary(document: str) -> dict[str, float]:
    lengths = sentence_lengths(document)
    return {
        "words": sum(word_counts(document).values()),
        "sentences": len(lengths),
        "average_word_length": average_word_length(document),
        "average_sentence_length": sum(lengths) / len(lengths) if lengths else 0.0,
    }
