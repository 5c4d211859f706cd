"""Generate workloads/data/corpus.txt: the prose that synthetic prompts are cut from.

The text is generated here (seeded, so the file is reproducible) from hand-written sentence templates
and word lists, so it is free of any copyright and nothing is downloaded. It only needs to be varied
English prose with a natural token mix; nobody has to enjoy reading it.

    .venv/bin/python scripts/make_corpus.py            # writes workloads/data/corpus.txt
"""

from __future__ import annotations

import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "workloads" / "data" / "corpus.txt"

PEOPLE = [
    "the engineer",
    "a young farmer",
    "the old librarian",
    "my neighbour",
    "the ship's captain",
    "a travelling merchant",
    "the village doctor",
    "her younger brother",
    "the night watchman",
    "a curious student",
    "the baker on the corner",
    "the mayor",
    "an astronomer",
    "the carpenter",
    "a quiet weaver",
    "the schoolteacher",
    "the river pilot",
    "a tired courier",
    "the gardener",
    "the archivist",
    "a retired sailor",
    "the lighthouse keeper",
    "two cousins",
    "the orchestra",
]
PLACES = [
    "the harbour",
    "the northern valley",
    "a small railway station",
    "the market square",
    "the edge of the forest",
    "an abandoned mill",
    "the university library",
    "the mountain pass",
    "a crowded kitchen",
    "the old observatory",
    "the riverbank",
    "a workshop full of tools",
    "the city archive",
    "a windy hill",
    "the salt marshes",
    "the glasshouse",
    "the town hall",
]
THINGS = [
    "a brass compass",
    "the weather report",
    "a basket of apples",
    "the broken clock",
    "a map drawn in pencil",
    "the quarterly accounts",
    "a letter without a stamp",
    "the new bridge",
    "a jar of honey",
    "the survey results",
    "a wooden boat",
    "the recipe book",
    "a pair of boots",
    "the telescope",
    "a bundle of letters",
    "the harvest figures",
    "a lantern",
    "the timetable",
    "the lecture notes",
    "a box of seeds",
    "the railway schedule",
    "a violin",
    "the census records",
]
VERBS_T = [
    "repaired",
    "carried",
    "studied",
    "measured",
    "described",
    "painted",
    "counted",
    "borrowed",
    "returned",
    "examined",
    "copied",
    "weighed",
    "collected",
    "sorted",
    "explained",
    "questioned",
    "photographed",
    "polished",
    "replaced",
    "catalogued",
    "translated",
    "packed",
    "inspected",
]
VERBS_I = [
    "waited",
    "laughed",
    "hesitated",
    "listened",
    "wandered off",
    "fell asleep",
    "kept working",
    "looked away",
    "sang quietly",
    "complained",
    "changed the subject",
    "went home early",
]
ADJ = [
    "quiet",
    "bright",
    "muddy",
    "careful",
    "ancient",
    "enormous",
    "fragile",
    "restless",
    "cheerful",
    "narrow",
    "golden",
    "peculiar",
    "crowded",
    "patient",
    "damp",
    "silver",
    "forgotten",
    "stubborn",
    "gentle",
    "noisy",
    "ordinary",
    "remarkable",
    "bitter",
    "generous",
    "hollow",
    "steep",
]
TIMES = [
    "in the morning",
    "after supper",
    "late in the autumn",
    "before the first snow",
    "at noon",
    "during the long winter",
    "on a Tuesday",
    "just after sunrise",
    "in the spring of that year",
    "while the rain fell",
    "at the end of the week",
    "some years later",
    "before anyone woke up",
]
ABSTRACT = [
    "patience",
    "memory",
    "the weather",
    "the price of bread",
    "good manners",
    "the tides",
    "friendship",
    "arithmetic",
    "the history of the town",
    "music",
    "honest work",
    "the seasons",
    "the stars",
    "the harvest",
    "old promises",
    "the cost of repairs",
    "a long journey",
    "silence",
]
NUMBERS = ["two", "three", "seven", "twelve", "forty", "a hundred", "several", "a dozen", "nine"]

TEMPLATES = [
    "{P} {vt} {t} {time}.",
    "{Time}, {p} {vt} {t} at {place}.",
    "Nobody at {place} remembered why {p} had {vt} {t}.",
    "{P} said that {abs} mattered more than {t}.",
    "It was a {a} day, and {p} {vi}.",
    "The {a} light over {place} made {p} think about {abs}.",
    "{P} walked to {place} with {t} and {num} {a} ideas.",
    "When {p} finally {vt} {t}, {p2} {vi}.",
    '"Are you sure about {abs}?" asked {p}.',
    '"We should leave before dark," said {p}, looking at {t}.',
    "There were {num} reasons to distrust {t}, but {p} ignored all of them.",
    "{P} kept {t} in a {a} drawer near {place}.",
    "Everyone agreed that {abs} was {a}, although {p} disagreed.",
    "By the time {p} reached {place}, {p2} had already {vt} {t}.",
    "In {year}, {p} wrote {num} pages about {abs}.",
    "The road to {place} was {a} and {a2}.",
    "{P} {vi}; {p2} {vt} {t} instead.",
    "Some said {abs} was only a matter of time; {p} was not so sure.",
    "{P} counted {n} steps from {place} to the door.",
    "Nothing about {t} seemed {a} until {p} {vt} it a second time.",
]


def sentence(rng: random.Random) -> str:
    p, p2 = rng.sample(PEOPLE, 2)
    time = rng.choice(TIMES)
    s = rng.choice(TEMPLATES).format(
        p=p,
        P=p[0].upper() + p[1:],
        p2=p2,
        vt=rng.choice(VERBS_T),
        vi=rng.choice(VERBS_I),
        t=rng.choice(THINGS),
        place=rng.choice(PLACES),
        a=rng.choice(ADJ),
        a2=rng.choice(ADJ),
        abs=rng.choice(ABSTRACT),
        time=time,
        Time=time[0].upper() + time[1:],
        num=rng.choice(NUMBERS),
        year=rng.randint(1700, 1999),
        n=rng.randint(10, 999),
    )
    return s[0].upper() + s[1:]


def main(paragraphs: int = 700, seed: int = 20261121) -> None:
    rng = random.Random(seed)
    paras = [" ".join(sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(paragraphs)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {paragraphs} paragraphs)")


if __name__ == "__main__":
    main()
