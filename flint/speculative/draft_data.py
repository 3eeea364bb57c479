"""The draft's training data: the built-in prompt set, the harvest of the target's hidden states,
and the ranking of the tokens the target generated (the drafting vocabulary).

    prompt set  ``flint-draft-prompts-v1``: code, explain, qa, chat; templated subjects x
                instructions, deterministic, about one subject in ten held out for evaluation.
                ``flint-draft-prompts-v2``: v1 plus more tasks, languages, topics, phrasings, and
                rewrite / codeedit prompts that hand the model a text or code to change
                ``flint-workloads-v1`` (flint/data/workloads.json, ``workload_prompts``): conversations for
                the speculative bench, input-grounded and open-ended kinds, with a held-out split
    harvest     the target generates continuations of the prompts, batched, and stores the tokens
                and the hidden states the draft learns from as resumable safetensors shards; one
                pass greedy, further passes sampled from the target's distribution
    rank_vocab  tokens by how often the target generated them; flint.speculative.draft_head saves and loads it

Run through ``flint draft harvest`` / ``flint draft vocab`` (flint/speculative/cli.py). Tests:
``pytest tests/test_draft.py tests/test_draft_data2.py``.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .draft_head import FORMAT, DraftError, target_fingerprint

PROMPT_SET = "flint-draft-prompts-v1"
PROMPT_SET_V2 = "flint-draft-prompts-v2"
KINDS = ("code", "explain", "qa", "chat")  # v1's kinds
ALL_KINDS = KINDS + ("rewrite", "codeedit")  # v2 adds prompts whose answer repeats the prompt
WORKLOADS = "flint-workloads-v1"  # the workload prompt set (bench only: its conversations have several messages)
WORKLOADS_FILE = Path(__file__).parent.parent / "data" / "workloads.json"


# ------------------------------------------------------------------ the prompt set

_LANGS = ["Python", "JavaScript", "TypeScript", "C", "C++", "Rust", "Go", "Java", "Bash", "SQL"]
_CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the nth Fibonacci number",
    "sorts a list of numbers with merge sort", "finds the largest element in an array",
    "counts the words in a text", "removes duplicates from a list", "reads a CSV file and sums a column",
    "implements binary search", "checks whether a string is a palindrome", "merges two sorted lists",
    "computes the factorial of a number", "converts Celsius to Fahrenheit", "flattens a nested list",
    "validates an email address", "implements a stack with push and pop", "computes the GCD of two numbers",
    "finds all anagrams of a word in a list", "parses a date string", "implements a simple linked list",
    "counts the vowels in a string", "rotates a matrix by 90 degrees", "generates all permutations of a list",
    "implements a queue using two stacks", "computes the average of a list", "capitalizes every word",
    "checks whether parentheses are balanced", "implements bubble sort", "finds the second largest number",
    "converts a number to binary", "computes the sum of digits of a number", "implements a LRU cache",
    "reads a file and prints the longest line", "finds the intersection of two lists",
    "implements quicksort", "checks whether two strings are anagrams", "counts character frequencies",
    "implements depth-first search on a graph", "implements breadth-first search on a graph",
    "computes the power set of a set", "transposes a matrix", "finds the missing number in a range",
    "splits a list into chunks", "implements a binary search tree insert", "computes a running average",
    "formats a number with thousands separators", "finds the longest common prefix of strings",
    "implements FizzBuzz", "retries a function call with exponential backoff", "computes a SHA-256 hash",
]
_CODE_TEMPLATES = ["Write a {lang} function that {task}.", "Implement a {lang} program that {task}.",
                   "Show me {lang} code that {task}, with comments.",
                   "How would I write code in {lang} that {task}? Give an example."]
_TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "machine learning", "blockchain", "inflation",
    "the immune system", "plate tectonics", "quantum computing", "the French Revolution", "vaccines",
    "climate change", "the stock market", "DNA replication", "neural networks", "the internet",
    "compound interest", "gravity", "the Roman Empire", "renewable energy", "recursion", "encryption",
    "supply and demand", "the theory of evolution", "volcanoes", "the human heart", "cloud computing",
    "electric cars", "the greenhouse effect", "operating systems", "databases", "the Renaissance",
    "sleep", "nutrition", "the solar system", "earthquakes", "antibiotics", "the printing press",
    "democracy", "memory in the brain", "tides", "rainbows", "compilers", "hash tables", "TCP/IP",
    "garbage collection", "the Big Bang", "magnetism", "batteries", "3D printing", "bees and pollination",
    "coral reefs", "the Industrial Revolution", "GPS", "solar panels", "the moon landing", "caching",
    "version control with git", "the scientific method", "probability", "statistics", "algorithms",
    "photosynthesis in algae", "ocean currents", "the nervous system", "weather forecasting",
    "programming languages", "virtual memory", "public key cryptography", "sorting algorithms",
]
_EXPLAIN_TEMPLATES = ["Explain {t} in simple terms.", "Explain how {t} works.",
                      "What is {t} and why does it matter?", "Give a short overview of {t} for a beginner.",
                      "Describe {t} in a few paragraphs.", "Teach me the basics of {t}."]
_QA_TEMPLATES = ["What are the main facts about {t}?", "List five interesting facts about {t}.",
                 "What are common misconceptions about {t}?",
                 "What are the advantages and disadvantages of {t}?",
                 "Who were the key people involved in {t}?",
                 "What questions do students often ask about {t}?"]
_CHAT_SUBJECTS = [
    "a rainy day", "friendship", "the ocean", "a lost cat", "autumn leaves", "a robot learning to paint",
    "a trip to the mountains", "starting a new job", "a small bakery", "the first day of school",
    "a city at night", "a garden", "a dragon who loves books", "learning to cook", "a long train ride",
    "moving to a new city", "a birthday party", "a lighthouse keeper", "winter mornings", "a marathon",
    "a family dinner", "a space explorer", "a quiet library", "a summer festival", "an old clock",
    "a snowy forest", "a coffee shop", "learning a new language", "a soccer match", "a music lesson",
    "a camping trip", "an inventor's workshop", "a farmer's market", "a haunted house", "the night sky",
    "a job interview", "a wedding", "a museum visit", "a science fair", "a road trip",
    "a talking tree", "a pirate ship", "a small village", "a busy airport", "saving money",
]
_CHAT_TEMPLATES = ["Write a short poem about {t}.", "Write a short story about {t}.",
                   "Write a friendly email to a colleague about {t}.", "Give me some tips related to {t}.",
                   "Write a diary entry about {t}.", "Write a product description inspired by {t}.",
                   "Help me write a speech about {t}."]


def _heldout(kind: str, subject: str) -> bool:
    """About one subject in ten per kind is held out: eval prompts have subjects training never saw."""
    return int(hashlib.sha256(f"{kind}|{subject}".encode()).hexdigest(), 16) % 10 == 0


def _rows_v1() -> list[tuple[str, str, str]]:
    """(kind, subject, text) of flint-draft-prompts-v1: code (languages x tasks), explain and qa
    (topics x instructions), chat (writing requests)."""
    out = []
    for task in _CODE_TASKS:
        for lang in _LANGS:
            for tpl in _CODE_TEMPLATES:
                out.append(("code", task, tpl.format(lang=lang, task=task)))
    for t in _TOPICS:
        out += [("explain", t, tpl.format(t=t)) for tpl in _EXPLAIN_TEMPLATES]
        out += [("qa", t, tpl.format(t=t)) for tpl in _QA_TEMPLATES]
    for t in _CHAT_SUBJECTS:
        out += [("chat", t, tpl.format(t=t)) for tpl in _CHAT_TEMPLATES]
    return out


# ------------------------------------------------------------------ flint-draft-prompts-v2
# v1's prompts and hold-out, plus more tasks, languages, topics and phrasings, and two kinds whose
# answer repeats the prompt: rewriting a given paragraph, and changing given code.

_LANGS_V2 = _LANGS + ["Kotlin", "Swift", "Ruby", "PHP", "C#"]
_CODE_TASKS_V2 = _CODE_TASKS + [
    "parses command-line arguments", "downloads a web page and counts its links",
    "implements a min-heap", "computes the edit distance between two strings", "checks whether a year is a leap year",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral", "implements a trie",
    "finds the shortest path with Dijkstra's algorithm", "detects a cycle in a linked list",
    "computes the median of a list", "generates prime numbers with a sieve",
    "serializes an object to JSON", "reads a JSON file and prints a field", "implements a rate limiter",
    "counts the lines in a file", "replaces every tab in a file with four spaces", "implements insertion sort",
    "implements selection sort", "implements heap sort", "computes the dot product of two vectors",
    "multiplies two matrices", "implements a hash map with chaining", "finds the most common element in a list",
    "groups a list of words by their first letter", "checks whether a binary tree is balanced",
    "computes the height of a binary tree", "performs an in-order traversal of a binary tree",
    "implements a circular buffer", "parses a URL into its parts", "converts a string to title case",
    "removes whitespace from both ends of a string", "zips two lists into pairs",
    "computes the cumulative sum of a list", "finds all pairs in a list that sum to a target",
    "validates a phone number", "generates a random password", "implements a simple calculator",
    "converts a hexadecimal string to an integer",
]
_CODE_TEMPLATES_V2 = _CODE_TEMPLATES + [
    "Please write a function in {lang} that {task}.", "Can you give me a {lang} snippet that {task}?",
    "In {lang}, write code that {task} and explain how it works.",
    "I need a {lang} function that {task}. Include a usage example.",
    "Write a well-documented {lang} function that {task}.",
    "Create a {lang} class or module that {task}.",
]
_TOPICS_V2 = _TOPICS + [
    "the water table", "wind turbines", "nuclear fission", "nuclear fusion", "the Silk Road", "the Cold War",
    "the periodic table", "chemical bonds", "the speed of light", "sound waves", "the electromagnetic spectrum",
    "glaciers", "deserts", "rainforests", "the carbon cycle", "viruses",
    "bacteria", "the digestive system", "the skeleton", "muscles", "hormones",
    "interest rates", "taxes", "budgeting", "credit scores", "the law of large numbers", "prime numbers",
    "fractions", "geometry", "calculus", "linear algebra", "regular expressions", "unit testing",
    "object-oriented programming", "functional programming", "multithreading", "web browsers", "HTML and CSS",
    "REST APIs", "containers", "load balancing", "password hashing", "image compression", "search engines",
    "the Olympic Games", "the Great Wall of China", "ancient Egypt",
]
_EXPLAIN_TEMPLATES_V2 = _EXPLAIN_TEMPLATES + [
    "Can you explain {t} step by step?", "Write a short explanation of {t} with an example.",
    "How would you explain {t} to a ten-year-old?", "Summarize what is known about {t}.",
]
_QA_TEMPLATES_V2 = _QA_TEMPLATES + [
    "What is the most important thing to know about {t}?", "How does {t} affect everyday life?",
    "What are three key terms related to {t}, and what do they mean?",
    "Answer briefly: why is {t} important?",
]
_CHAT_SUBJECTS_V2 = _CHAT_SUBJECTS + [
    "a new puppy", "a broken umbrella", "the first snow of the year", "a grandmother's recipe",
    "a lost wallet", "a volunteer day", "a concert in the park", "a rainy weekend at home",
    "a chess tournament", "an old photograph", "a new bicycle", "a neighbor's garden", "a school play",
    "a bus that is always late", "a fishing trip", "a treehouse", "a thunderstorm", "a book club",
    "a street market", "a kite festival", "a surprise visit", "a vegetable garden", "a hiking trail",
    "an apartment with a view", "a first flight", "a rescued bird", "a tiny island", "a desert road",
    "a power outage", "a cooking contest", "a late-night conversation", "a field trip", "a new neighbor",
    "a quiet beach", "a snowman", "a homemade gift", "a team project", "a lucky coin", "a mountain cabin",
    "a graduation",
]
_CHAT_TEMPLATES_V2 = _CHAT_TEMPLATES + [
    "Write a haiku about {t}.", "Write a short letter to a friend about {t}.",
    "Write a social media post about {t}.", "Describe {t} in vivid detail.",
    "Write a short dialogue between two people about {t}.",
]

# (subject, paragraph): short texts the rewrite prompts hand to the model, written for this set
_PARAGRAPHS = [
    ("morning routine", "Every morning I wake up at six, drink a glass of water and go for a short walk. "
     "After the walk I make coffee and read the news for twenty minutes. Then I check my calendar and "
     "write down the three most important things I want to finish that day."),
    ("library opening", "The city library will open its new reading room next Monday. The room has large "
     "windows, forty quiet desks and a small section for children's books. Visitors can borrow laptops at "
     "the front desk with a library card."),
    ("team meeting", "Our weekly team meeting is moving from Tuesday to Thursday afternoon. The meeting will "
     "start at three o'clock and should last about an hour. Please send your updates to the team channel "
     "before noon so we can plan the agenda."),
    ("recycling rules", "Starting next month, plastic bottles and cans go in the blue bin and paper goes in "
     "the green bin. Glass must be taken to the collection point near the supermarket. Bins that contain the "
     "wrong items will not be emptied."),
    ("bees", "Bees visit flowers to collect nectar and pollen, which they bring back to the hive as food. "
     "While they move from flower to flower, they carry pollen with them and help plants produce seeds and "
     "fruit. Without bees, many crops would give much smaller harvests."),
    ("remote work", "Working from home saves time that would otherwise be spent commuting, and many people "
     "find they can focus better without office noise. However, it can also feel lonely, and it is harder "
     "to separate work from private life. Regular breaks and a fixed schedule help."),
    ("volcano", "A volcano forms where molten rock from deep inside the earth reaches the surface. When "
     "pressure builds up under the ground, the volcano can erupt and throw out lava, ash and gas. Some "
     "volcanoes erupt every few years, while others stay quiet for centuries."),
    ("bakery review", "The small bakery on Elm Street sells the best bread in town. Their sourdough has a "
     "crisp crust and a soft, slightly sour inside. The staff are friendly, although the shop gets very "
     "crowded on Saturday mornings, so it is worth going early."),
    ("software update", "A new version of the app is now available. It fixes a problem that caused the app "
     "to close unexpectedly when uploading photos, and it makes the search page load faster. We recommend "
     "that all users install the update as soon as possible."),
    ("exercise", "Regular exercise strengthens the heart, improves sleep and lifts the mood. Experts "
     "recommend at least thirty minutes of moderate activity, such as brisk walking, on most days of the "
     "week. Even short walks during the day are better than sitting for hours."),
    ("train delay", "Due to repairs on the line, trains between the north station and the airport will run "
     "every thirty minutes instead of every fifteen this weekend. Passengers should plan extra time for "
     "their journey. Normal service will return on Monday morning."),
    ("moon", "The moon travels around the earth about once every twenty-seven days. It does not make its own "
     "light; we see it because it reflects light from the sun. As it moves, we see different amounts of its "
     "lit side, which is why its shape seems to change during the month."),
    ("job application", "I am writing to apply for the position of junior designer at your company. I "
     "recently finished my degree in graphic design and have worked on several projects for local "
     "businesses. I would be glad to show you my portfolio and discuss how I could help your team."),
    ("water saving", "There are simple ways to save water at home. Turn off the tap while brushing your "
     "teeth, take shorter showers and only run the washing machine when it is full. Fixing a dripping tap "
     "can save thousands of liters a year."),
    ("history of the bicycle", "The first bicycles, built in the early nineteenth century, had no pedals: "
     "riders pushed themselves along with their feet. Pedals were added decades later, and by the end of the "
     "century bicycles with chains and air-filled tires looked much like the ones we ride today."),
    ("school trip", "Next Friday the class will visit the science museum. The bus leaves the school at "
     "eight thirty and returns at three. Students should bring a packed lunch, a notebook and a jacket, as "
     "part of the visit takes place outdoors."),
    ("password advice", "A strong password is long and hard to guess. Instead of a single word, use a "
     "phrase of several unrelated words, and never use the same password for two accounts. A password "
     "manager can remember them for you."),
    ("coffee", "Coffee is made from the roasted seeds of a fruit that grows on small trees in warm "
     "countries. After harvest the seeds are dried, roasted and ground. The roast changes the taste: light "
     "roasts are more acidic, while dark roasts taste stronger and more bitter."),
    ("customer complaint", "I ordered a blue jacket from your online store two weeks ago, but I received a "
     "green one in the wrong size. I have already sent it back with the return label. Please send me the "
     "correct jacket or refund my money."),
    ("rainforest", "Tropical rainforests cover a small part of the earth's surface but are home to more than "
     "half of all known plant and animal species. Their trees store large amounts of carbon. Every year, "
     "large areas are cleared for farming and logging."),
    ("new phone", "My new phone has a bigger screen and a much better camera than my old one. The battery "
     "lasts almost two days, which is great when I travel. The only thing I miss is the headphone jack, so I "
     "had to buy an adapter."),
    ("garden tips", "Tomatoes need at least six hours of sun a day and regular watering. Water them at the "
     "base in the morning rather than on the leaves. Tie the stems to a stick as they grow so the plants do "
     "not fall over when the fruit gets heavy."),
    ("old maps", "Old maps were drawn by hand from the reports of travelers and sailors. Many of them "
     "showed coasts quite accurately but left the inside of continents nearly empty or filled it with "
     "guesses. Today, satellite images and survey data let map makers show every road and river."),
    ("meeting notes", "In today's meeting we agreed to launch the new website in March. Anna will finish the "
     "design by the end of January, and Tom will test the pages on phones and tablets. The budget for "
     "advertising still needs to be approved by the manager."),
    ("sleep", "Most adults need between seven and nine hours of sleep a night. Going to bed at the same time "
     "every day, keeping the bedroom dark and avoiding screens before bed all help. Too little sleep makes it "
     "harder to concentrate and remember things."),
    ("public transport", "Buses and trams move many people with far less space and fuel per person than "
     "cars. A good network runs often, connects well between lines and has clear timetables. When service "
     "is reliable, more people leave their cars at home."),
    ("museum", "The town museum has a collection of old tools, maps and photographs that show how people "
     "lived here a hundred years ago. Entry is free on the first Sunday of every month. Guided tours are "
     "available in the afternoon."),
    ("cooking rice", "To cook rice, rinse it in cold water until the water runs clear. Put one cup of rice "
     "and two cups of water in a pot, bring it to a boil, then cover it and let it simmer on low heat for "
     "about fifteen minutes. Let it rest for five minutes before serving."),
    ("composting", "Composting turns kitchen scraps and garden waste into rich soil. Mix green material, "
     "such as vegetable peels and grass, with brown material, such as dry leaves and paper. Keep the pile "
     "damp and turn it every few weeks so air can reach the middle."),
    ("birthday invitation", "You are invited to Maya's tenth birthday party on Saturday at two o'clock in "
     "the park behind the school. There will be games, cake and a treasure hunt. Please let us know by "
     "Wednesday if your child can come."),
    ("online course", "The online course has eight weeks of video lessons and short quizzes. Each week takes "
     "about three hours. Students who pass the final project receive a certificate, and they can ask the "
     "teachers questions in a weekly live session."),
    ("octopus", "An octopus has eight arms, three hearts and blue blood. It can change the color and "
     "texture of its skin in a fraction of a second to hide from predators. Octopuses are also known for "
     "solving puzzles and escaping from tanks."),
    ("apartment listing", "Bright two-room apartment for rent near the city center. The kitchen was renovated "
     "last year and the living room has a small balcony facing the park. Shops, a school and a bus stop are "
     "within a five-minute walk."),
    ("habit", "Building a new habit is easier when you start small. If you want to read more, begin with "
     "five pages a day and read at the same time each evening. Tracking your progress on a calendar makes it "
     "more likely that you will keep going."),
    ("old bridge", "The stone bridge over the river was built about three hundred years ago and was the "
     "only way across for miles. It was closed to cars in the nineteen eighties after cracks appeared. "
     "Now it is open to walkers and cyclists, and a market is held on it every summer."),
    ("product launch", "We are excited to introduce our new water bottle. It keeps drinks cold for a full "
     "day, fits in most car cup holders and is made from recycled steel. It comes in five colors and will be "
     "in stores from the first of May."),
    ("first aid", "If someone has a small cut, wash your hands and then clean the wound with water. Press a "
     "clean cloth on it to stop the bleeding and cover it with a bandage. See a doctor if the cut is deep or "
     "shows signs of infection."),
    ("chess", "Chess is played on a board of sixty-four squares by two players who each start with sixteen "
     "pieces. The goal is to trap the other player's king so that it cannot escape. Good players think "
     "several moves ahead and try to control the center of the board."),
]
_REWRITE_TEMPLATES = [
    "Rewrite this paragraph in a formal tone:\n\n{text}",
    "Summarize the following paragraph in one sentence:\n\n{text}",
    "Make this text shorter without losing the main points:\n\n{text}",
    "Fix the spelling and grammar in this text:\n\n{typo}",
    "Correct the mistakes in the following paragraph and return the corrected version:\n\n{typo}",
    "Turn this paragraph into a bulleted list of key points:\n\n{text}",
    "Rewrite this so that a ten-year-old can understand it:\n\n{text}",
    "Give this paragraph a title, then rewrite it more clearly:\n\n{text}",
    "Paraphrase the following text:\n\n{text}",
    "{text}\n\nSummarize the text above in three bullet points.",
    "{text}\n\nRewrite the text above in the first person.",
    "Rewrite the following text so it sounds more enthusiastic:\n\n{text}",
    "Expand this paragraph with more detail:\n\n{text}",
    "Turn this paragraph into a short email to a friend:\n\n{text}",
    "Text: {text}\n\nWrite a one-line summary of this text.",
    "Proofread this paragraph:\n\n{typo}",
    "Rewrite this paragraph in the past tense:\n\n{text}",
    "Here is a paragraph:\n\"{text}\"\nRewrite it in a friendlier tone.",
]

# (subject, language, code, (correct fragment, buggy fragment) or None): code the code-edit
# prompts hand to the model, written for this set; the pair makes the buggy version
_SNIPPETS = [
    ("py average", "Python", "def average(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
     "    return total / len(numbers)", ("total / len(numbers)", "total / (len(numbers) - 1)")),
    ("py count words", "Python", "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
     "        counts[word] = counts.get(word, 0) + 1\n    return counts", ("counts.get(word, 0) + 1", "1")),
    ("py merge dicts", "Python", "def merge_counts(a, b):\n    result = dict(a)\n    for key, value in b.items():\n"
     "        result[key] = result.get(key, 0) + value\n    return result", ("result.get(key, 0) + value", "value")),
    ("py read lines", "Python", "def read_lines(path):\n    with open(path) as f:\n"
     "        return [line.strip() for line in f if line.strip()]", None),
    ("py is prime", "Python", "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n"
     "    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True",
     ("while i * i <= n", "while i * i < n")),
    ("py fizzbuzz", "Python", "for i in range(1, 101):\n    if i % 15 == 0:\n        print(\"FizzBuzz\")\n"
     "    elif i % 3 == 0:\n        print(\"Fizz\")\n    elif i % 5 == 0:\n        print(\"Buzz\")\n    else:\n"
     "        print(i)", ("range(1, 101)", "range(1, 100)")),
    ("py class account", "Python", "class Account:\n    def __init__(self, owner, balance=0):\n"
     "        self.owner = owner\n        self.balance = balance\n\n    def deposit(self, amount):\n"
     "        self.balance += amount\n\n    def withdraw(self, amount):\n        if amount > self.balance:\n"
     "            raise ValueError(\"insufficient funds\")\n        self.balance -= amount",
     ("self.balance -= amount", "self.balance += amount")),
    ("py reverse words", "Python", "def reverse_words(sentence):\n    words = sentence.split()\n"
     "    return \" \".join(reversed(words))", None),
    ("py binary search", "Python", "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n"
     "    while lo <= hi:\n        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
     "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
     "    return -1",
     ("lo = mid + 1", "lo = mid")),
    ("py filter even", "Python", "def even_numbers(values):\n    result = []\n    for v in values:\n"
     "        if v % 2 == 0:\n            result.append(v)\n    return result", ("v % 2 == 0", "v % 2 == 1")),
    ("js sum array", "JavaScript", "function sumArray(arr) {\n  let total = 0;\n"
     "  for (let i = 0; i < arr.length; i++) {\n    total += arr[i];\n  }\n  return total;\n}",
     ("i < arr.length", "i <= arr.length")),
    ("js fetch user", "JavaScript", "async function getUser(id) {\n"
     "  const response = await fetch(`/api/users/${id}`);\n  const data = await response.json();\n"
     "  return data.name;\n}", None),
    ("js capitalize", "JavaScript", "function capitalize(word) {\n"
     "  return word.charAt(0).toUpperCase() + word.slice(1);\n}", ("word.slice(1)", "word.slice(0)")),
    ("js debounce", "JavaScript", "function debounce(fn, delay) {\n  let timer;\n  return (...args) => {\n"
     "    clearTimeout(timer);\n    timer = setTimeout(() => fn(...args), delay);\n  };\n}",
     ("    clearTimeout(timer);\n", "")),
    ("ts interface", "TypeScript", "interface User {\n  id: number;\n  name: string;\n}\n\n"
     "function greet(user: User): string {\n  return \"Hello, \" + user.name;\n}", None),
    ("c string length", "C", "int string_length(const char *s) {\n    int n = 0;\n    while (s[n] != '\\0') {\n"
     "        n++;\n    }\n    return n;\n}", ("        n++;\n", "")),
    ("c swap", "C", "void swap(int *a, int *b) {\n    int tmp = *a;\n    *a = *b;\n    *b = tmp;\n}",
     ("*b = tmp;", "*b = *a;")),
    ("c count char", "C", "int count_char(const char *s, char c) {\n    int n = 0;\n"
     "    for (int i = 0; s[i] != '\\0'; i++) {\n        if (s[i] == c) n++;\n    }\n    return n;\n}",
     ("if (s[i] == c) n++;", "if (s[i] = c) n++;")),
    ("go reverse", "Go", "func Reverse(s string) string {\n    r := []rune(s)\n"
     "    for i, j := 0, len(r)-1; i < j; i, j = i+1, j-1 {\n        r[i], r[j] = r[j], r[i]\n    }\n"
     "    return string(r)\n}", ("i, j = i+1, j-1", "i, j = i+1, j")),
    ("go http handler", "Go", "func hello(w http.ResponseWriter, r *http.Request) {\n"
     "    name := r.URL.Query().Get(\"name\")\n    fmt.Fprintf(w, \"Hello, %s!\", name)\n}", None),
    ("rust factorial", "Rust", "fn factorial(n: u64) -> u64 {\n    if n == 0 {\n        1\n    } else {\n"
     "        n * factorial(n - 1)\n    }\n}", ("if n == 0", "if n == 1")),
    ("rust vec sum", "Rust", "fn sum(values: &[i32]) -> i32 {\n    let mut total = 0;\n    for v in values {\n"
     "        total += v;\n    }\n    total\n}", None),
    ("java counter", "Java", "public class Counter {\n    private int count = 0;\n\n"
     "    public void increment() {\n        count++;\n    }\n\n    public int getCount() {\n        return count;\n"
     "    }\n}", ("count++;", "count--;")),
    ("java palindrome", "Java", "public static boolean isPalindrome(String s) {\n    int i = 0, j = s.length() - 1;\n"
     "    while (i < j) {\n        if (s.charAt(i) != s.charAt(j)) return false;\n        i++;\n        j--;\n    }\n"
     "    return true;\n}", ("j = s.length() - 1", "j = s.length()")),
    ("sql top customers", "SQL", "SELECT customer_id, SUM(amount) AS total\nFROM orders\n"
     "GROUP BY customer_id\nORDER BY total DESC\nLIMIT 10;", ("ORDER BY total DESC", "ORDER BY total")),
    ("sql join", "SQL", "SELECT e.name, d.name AS department\nFROM employees e\n"
     "JOIN departments d ON e.department_id = d.id\nWHERE e.active = 1;", None),
    ("bash backup", "Bash", "#!/bin/bash\nsrc=\"$HOME/documents\"\ndest=\"/backup/$(date +%Y-%m-%d)\"\n"
     "mkdir -p \"$dest\"\ncp -r \"$src\" \"$dest\"\necho \"Backup done: $dest\"", ("mkdir -p", "mkdir")),
    ("bash count files", "Bash", "#!/bin/bash\nfor dir in \"$@\"; do\n    n=$(ls \"$dir\" | wc -l)\n"
     "    echo \"$dir: $n files\"\ndone", None),
    ("cpp vector average", "C++", "double average(const std::vector<double>& v) {\n    double sum = 0;\n"
     "    for (double x : v) sum += x;\n    return sum / v.size();\n}", None),
    ("ruby greet", "Ruby", "def greet(names)\n  names.each do |name|\n    puts \"Hello, #{name}!\"\n  end\nend", None),
]
_CODE_EDIT_TEMPLATES = [
    "Add comments to this {lang} code:\n\n{code}",
    "Rewrite this {lang} code to make it more readable:\n\n{code}",
    "Translate this {lang} code into {other}:\n\n{code}",
    "Add error handling to the following {lang} code.\n\n{code}",
    "Rename the variables in this {lang} code to more descriptive names:\n\n{code}",
    "Write unit tests for this {lang} code:\n\n{code}",
    "Explain what this {lang} code does, line by line:\n\n{code}",
    "Add documentation comments to this {lang} code:\n\n{code}",
    "Change this {lang} code so it handles empty or invalid input:\n\n{code}",
    "Make this {lang} code more efficient and show the new version:\n\n{code}",
    "{code}\n\nRefactor the {lang} code above into smaller functions.",
    "Here is some {lang} code:\n```\n{code}\n```\nChange it so that it also logs what it does.",
    "Review this {lang} code and suggest improvements:\n\n{code}",
]
_CODE_FIX_TEMPLATES = [
    "This {lang} code has a bug. Find it and fix it:\n\n{buggy}",
    "Why does this {lang} code give the wrong result? Show the corrected code.\n\n{buggy}",
    "Fix the bug in this code:\n```\n{buggy}\n```",
]


def _typos(text: str, subject: str) -> str:
    """``text`` with about one word in six misspelt (two letters swapped, one doubled or dropped),
    the same every time."""
    rng = random.Random(f"typos|{subject}")
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) < 4 or not w.isalpha() or rng.random() > 0.17:
            continue
        j = rng.randrange(1, len(w) - 2)
        op = rng.randrange(3)
        if op == 0:
            w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
        elif op == 1:
            w = w[:j] + w[j] + w[j:]
        else:
            w = w[:j] + w[j + 1:]
        words[i] = w
    return " ".join(words)


def _rows_v2() -> list[tuple[str, str, str]]:
    """(kind, subject, text) of flint-draft-prompts-v2: v1's first, then the additions. A (task,
    language) or subject v1 has keeps its phrasings and gains two; a new one gets a few phrasings
    picked per subject, so the set grows without crossing every list with every other."""
    out = _rows_v1()
    rng = random.Random("flint-draft-prompts-v2")
    new_code = _CODE_TEMPLATES_V2[len(_CODE_TEMPLATES):]
    for task in _CODE_TASKS_V2:
        for lang in _LANGS_V2:
            if task in _CODE_TASKS and lang in _LANGS:
                tpls = rng.sample(new_code, 1)
            else:
                tpls = rng.sample(_CODE_TEMPLATES_V2, 3)
            out += [("code", task, tpl.format(lang=lang, task=task)) for tpl in tpls]
    for kind, tpls_v1, tpls_v2 in (("explain", _EXPLAIN_TEMPLATES, _EXPLAIN_TEMPLATES_V2),
                                   ("qa", _QA_TEMPLATES, _QA_TEMPLATES_V2)):
        for t in _TOPICS_V2:
            pick = tpls_v2[len(tpls_v1):] if t in _TOPICS else rng.sample(tpls_v2, 7)
            out += [(kind, t, tpl.format(t=t)) for tpl in pick]
    for t in _CHAT_SUBJECTS_V2:
        pick = rng.sample(_CHAT_TEMPLATES_V2[len(_CHAT_TEMPLATES):], 3) if t in _CHAT_SUBJECTS \
            else rng.sample(_CHAT_TEMPLATES_V2, 8)
        out += [("chat", t, tpl.format(t=t)) for tpl in pick]
    for subject, text in _PARAGRAPHS:
        typo = _typos(text, subject)
        out += [("rewrite", subject, tpl.format(text=text, typo=typo)) for tpl in _REWRITE_TEMPLATES]
    langs = sorted({lang for _, lang, _, _ in _SNIPPETS})
    for subject, lang, code, bug in _SNIPPETS:
        other = rng.choice([x for x in langs if x not in (lang, "SQL", "Bash")])
        out += [("codeedit", subject, tpl.format(lang=lang, code=code, other=other)) for tpl in _CODE_EDIT_TEMPLATES]
        if bug is not None:
            good, bad = bug
            if good not in code:
                raise AssertionError(f"snippet {subject!r}: bug fragment not in the code")
            buggy = code.replace(good, bad, 1)
            out += [("codeedit", subject, tpl.format(lang=lang, buggy=buggy)) for tpl in _CODE_FIX_TEMPLATES]
    return out


PROMPT_SETS = {PROMPT_SET: (_rows_v1, KINDS), PROMPT_SET_V2: (_rows_v2, ALL_KINDS)}


def resolve_prompt_set(name: str) -> str:
    """A prompt set's full name from it or its short form ('v1', 'v2')."""
    full = name if name in PROMPT_SETS else f"flint-draft-prompts-{name}"
    if full not in PROMPT_SETS:
        raise DraftError(f"--prompt-set: unknown prompt set {name!r}; choose from "
                         + ", ".join(f"{n.rsplit('-', 1)[1]} ({n})" for n in PROMPT_SETS))
    return full


def draft_prompts(split: str | None = None, prompt_set: str = PROMPT_SET) -> list[dict]:
    """A prompt set (default flint-draft-prompts-v1): [{'kind', 'text', 'subject', 'split'}],
    deterministic. split 'train' or 'eval' (held out by subject, the same rule in every set, so a
    subject v1 holds out v2 holds out too), None for both."""
    rows_fn, _ = PROMPT_SETS[resolve_prompt_set(prompt_set)]
    seen, rows = set(), []
    for k, s, text in rows_fn():
        if text not in seen:
            seen.add(text)
            rows.append({"kind": k, "text": text, "subject": s, "split": "eval" if _heldout(k, s) else "train"})
    random.Random(0).shuffle(rows)
    return [r for r in rows if split is None or r["split"] == split]


def workload_prompts(split: str | None = None) -> list[dict]:
    """The workload prompt set (flint/data/workloads.json, ``flint-workloads-v1``): [{'kind', 'subject', 'split',
    'messages', 'text'}] in file order; 'messages' is the conversation (a system prompt, earlier turns, a tool's
    result), 'text' its last message. Kinds whose answer is grounded in the input (edit a given file or text,
    summarise or extract from a document, quote a context, JSON from a record, a chat whose answer restates earlier
    turns, an agent echoing a tool's result) and open-ended ones (code, explain, qa, chat); split 'train' (for
    tuning) or 'eval' (held out: whole subjects), None for both."""
    if split not in (None, "train", "eval"):
        raise DraftError(f"split must be 'train', 'eval' or None, got {split!r}")
    doc = json.loads(WORKLOADS_FILE.read_text())
    return [{**r, "text": r["messages"][-1]["content"]} for r in doc["prompts"] if split in (None, r["split"])]


def eval_prompts(per_kind: int, kinds=None, prompt_set: str = PROMPT_SET, split: str = "eval") -> list[dict]:
    """``per_kind`` prompts of each kind (default: the set's kinds) of a split (default the held-out one), spread over
    subjects. ``prompt_set`` 'workloads' takes them from workload_prompts."""
    if prompt_set in ("workloads", WORKLOADS):
        rows = workload_prompts(split)
        kinds = kinds or list(dict.fromkeys(r["kind"] for r in rows))
    else:
        if split != "eval":
            raise DraftError(f"split {split!r}: the draft prompt sets' evaluation prompts are their held-out split; "
                             "their training split is for `flint draft harvest`")
        rows = draft_prompts("eval", prompt_set)
        kinds = kinds or PROMPT_SETS[resolve_prompt_set(prompt_set)][1]
    out = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        by_subject: dict[str, list] = {}
        for r in mine:
            by_subject.setdefault(r["subject"], []).append(r)
        order = [lst[i] for i in range(max(map(len, by_subject.values()), default=0))
                 for lst in by_subject.values() if i < len(lst)]
        out += order[:per_kind]
    return out


# ------------------------------------------------------------------ harvest

@dataclass
class HarvestData:
    """Per sequence, the region from the last prompt position P-1 on. Region index r is position
    P-1+r: tokens [N, G+1] (the last prompt token, then the G generated), hidden [N, G+1, H] (the
    target's last-layer hidden state there), lengths [N]: hidden states 0..length-1 are valid, and
    tokens 0..length (token `length` is the last generated one: eos or the G-th). group [N]: the
    prompt's subject (validation holds out whole subjects); kind [N]: index into ALL_KINDS, -1
    unknown."""
    tokens: torch.Tensor
    hidden: torch.Tensor
    lengths: torch.Tensor
    prompt_index: torch.Tensor
    meta: dict
    group: torch.Tensor | None = None
    kind: torch.Tensor | None = None
    pass_index: torch.Tensor | None = None  # [N] the harvest pass (0 for harvests without passes)
    temperature: torch.Tensor | None = None  # [N] its sampling temperature (0: a greedy sequence)

    def greedy_rows(self) -> torch.Tensor:
        """[N] bool: greedy sequences (None recorded: all are)."""
        if self.temperature is None:
            return torch.ones(self.lengths.shape[0], dtype=torch.bool)
        return self.temperature.cpu() == 0


def _prompt_key(ids) -> int:
    return int(hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest(), 16) % (2**62)


def _group_key(r: dict, index: int) -> int:
    if "subject" not in r:
        return index
    return int(hashlib.sha256(f"{r.get('kind')}|{r['subject']}".encode()).hexdigest(), 16) % (2**31)


@dataclass(frozen=True)
class Pass:
    """One pass of a harvest over the prompts: greedy (temperature 0) or sampled from the target's
    distribution at ``temperature`` with nucleus ``top_p`` (flint.engine.probs_from_logits, as the
    engine samples). Pass i's sequences are stored apart from pass j's, keyed (prompt, i)."""
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise DraftError(f"harvest pass: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DraftError(f"harvest pass: top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def harvest_passes(sampled: int = 0, temperatures=(0.7, 1.0), top_p: float = 0.95) -> list[Pass]:
    """Pass 0 greedy, then ``sampled`` sampled passes at ``temperatures`` in turn (a list cycles)."""
    if sampled < 0:
        raise DraftError(f"sampled passes must be >= 0, got {sampled}")
    temps = list(temperatures)
    if sampled and not temps:
        raise DraftError("sampled passes need at least one temperature")
    for t in temps:
        if not t > 0:
            raise DraftError(f"a sampled pass needs a temperature > 0, got {t}")
    return [Pass()] + [Pass(float(temps[i % len(temps)]), float(top_p)) for i in range(sampled)]


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (numpy's unsigned arithmetic wraps mod 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, pass_no: int, keys, n_pos: int) -> torch.Tensor:
    """u [len(keys), n_pos] in [0, 1), float64: the uniform that draws the token at position j of
    the sequence of prompt ``keys[r]`` in pass ``pass_no``. A counter-based stream: it depends on
    (seed, pass, prompt, position) only, not on which prompts share a batch, so a sampled pass is
    the same text whatever the batching and however often the harvest resumed."""
    with np.errstate(over="ignore"):
        base = _mix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ _mix64(
            np.array([pass_no + 1], dtype=np.uint64) * _GOLDEN))
        k = _mix64(np.asarray([int(x) for x in keys], dtype=np.uint64)[:, None] ^ base)
        x = _mix64(k + (np.arange(n_pos, dtype=np.uint64)[None, :] + np.uint64(1)) * _GOLDEN)
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, V], drawn from probs_from_logits(logits, temperature,
    top_p=top_p) (the engine's sampling distribution) by inverse CDF at the uniforms ``u`` [B]."""
    from ..engine import probs_from_logits

    p = probs_from_logits(logits, temperature, top_p=top_p)
    cdf = p.cumsum(-1)
    v = (u.to(cdf.device, torch.float64) * cdf[:, -1].double()).float()
    tok = torch.searchsorted(cdf, v[:, None], right=True)[:, 0].clamp_max(p.shape[-1] - 1)
    # a scan's rounding can step the CDF where p is 0: move such a draw to the next token with p > 0
    bad = p.gather(1, tok[:, None])[:, 0] <= 0
    if bool(bad.any()):
        pos = torch.arange(p.shape[-1], device=p.device)
        for r in bad.nonzero()[:, 0].tolist():
            ok = (p[r] > 0) & (pos >= tok[r])
            tok[r] = int(ok.int().argmax()) if bool(ok.any()) else int((p[r] > 0).nonzero()[-1])
    return tok


def _shard_pass(m: dict) -> tuple[int, Pass, int | None]:
    """(pass index, its Pass, its seed) from a shard's metadata; shards written before harvests had
    passes are pass 0 at their temperature."""
    t = float(m.get("temperature", 0.0))
    return int(m.get("pass", 0)), Pass(t, float(m.get("top_p", 1.0))), (int(m["seed"]) if "seed" in m else None)


def harvest(lm, out_dir: str | Path, prompts: list[dict], batch_size: int = 64,
            max_new_tokens: int = 256, temperature: float = 0.0, device=None,
            dtype: torch.dtype | None = None, time_budget: float | None = None, seed: int = 0,
            log=print, passes: list[Pass] | None = None, prompt_set: str = PROMPT_SET) -> int:
    """Self-distillation: generate continuations of ``prompts`` (rows with 'text', chat-templated,
    or pre-tokenized 'ids') with the target and write shards (one per batch) to ``out_dir``.

    ``passes``: one sequence per prompt and pass (default: one pass at ``temperature``), pass 0
    first; sampled passes draw with ``seed`` (sample_uniforms). Sequences already in a shard
    (keyed by prompt content and pass) are skipped, so a killed harvest resumes, and shards of
    another pass or an older harvest (pass 0) stay valid. Returns the number of sequences written."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ..model import Transformer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, tok = lm.cfg, lm.tokenizer
    if tok is None and any("ids" not in r for r in prompts):
        raise DraftError(f"{lm.source}: harvest needs a tokenizer (the prompts are text)")
    passes = list(passes) if passes is not None else [Pass(temperature)]
    if not passes:
        raise DraftError("harvest: no passes")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    meta = {"format": FORMAT + "-harvest", "prompt_set": prompt_set, "target": cfg.name,
            "fingerprint": target_fingerprint(cfg), "max_new_tokens": max_new_tokens,
            "hidden_size": cfg.hidden_size * (1 + len(Transformer.hidden_layers))}
    if Transformer.hidden_layers:  # (a draft-feature study's harvest: those layers' residuals, then the last's)
        meta["hidden_layers"] = ",".join(map(str, Transformer.hidden_layers))
    done = set()
    for sh in sorted(out.glob("shard_*.safetensors")):
        with safe_open(str(sh), framework="pt") as fh:
            m = fh.metadata() or {}
            for key in ("fingerprint", "max_new_tokens", "hidden_size"):
                if str(m.get(key)) != str(meta[key]):
                    raise DraftError(f"{sh}: metadata {key!r} is {m.get(key)!r}, this harvest uses "
                                     f"{meta[key]!r}; pass another --out to start a new harvest")
            pno, ps, pseed = _shard_pass(m)
            if pno < len(passes):
                want = passes[pno]
                same = ps == want if not want.greedy else ps.greedy
                if not same or (not want.greedy and pseed != seed):
                    raise DraftError(f"{sh}: pass {pno} was harvested at temperature {ps.temperature}, top_p "
                                     f"{ps.top_p}, seed {pseed}; this harvest asks temperature {want.temperature}, "
                                     f"top_p {want.top_p}, seed {seed} for it; pass another --out to start "
                                     "a new harvest")
            keys = fh.get_tensor("prompt_key").tolist()
            pas = fh.get_tensor("pass").tolist() if "pass" in fh.keys() else [pno] * len(keys)
            done.update(zip(keys, pas))
    encoded = []
    for i, r in enumerate(prompts):
        ids = r["ids"] if "ids" in r else tok.encode_chat([{"role": "user", "content": r["text"]}])
        encoded.append((i, list(ids), _prompt_key(ids)))
    todo = {}  # pass -> [(prompt index, ids, key)], each (prompt content, pass) once
    for pno in range(len(passes)):
        seen = set()
        for i, ids, key in encoded:
            if (key, pno) not in done and key not in seen:  # keyed by content: any list or order resumes
                seen.add(key)
                todo.setdefault(pno, []).append((i, ids, key))
    if not todo:
        log(f"harvest: all {len(prompts)} prompts x {len(passes)} pass(es) already in {out}")
        return 0
    # Batches mix prompt lengths: all rows share one position per step (the reference decoder takes
    # [B, M] at one start_pos), and a row whose prompt is not over yet is fed its next prompt token
    # instead of a generated one. Sorting by length keeps the extra steps per batch few.
    batches = []
    for pno, rows in sorted(todo.items()):
        rows.sort(key=lambda x: len(x[1]))
        mine = [rows[s: s + batch_size] for s in range(0, len(rows), batch_size)]
        random.Random(seed + 1000003 * pno).shuffle(mine)  # a time budget then leaves a mix of lengths and kinds
        batches += [(pno, b) for b in mine]
    longest = max(len(ids) for rows in todo.values() for _, ids, _ in rows)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        i = next(i for rows in todo.values() for i, ids, _ in rows if len(ids) == longest)
        raise DraftError(f"harvest: prompt {i} has {longest} tokens; with max_new_tokens={max_new_tokens} it "
                         f"exceeds the target's context ({cfg.max_position_embeddings} positions)")
    model = Transformer(cfg, lm.params, longest + max_new_tokens, device=device, dtype=dtype,
                        batch_size=min(batch_size, max(len(rows) for rows in todo.values())))
    eos = torch.tensor(sorted(set(cfg.eos_token_ids) or {-1}), device=device)
    shard_no = len(list(out.glob("shard_*.safetensors")))
    t0 = time.perf_counter()
    written = 0
    bar = tqdm(total=sum(len(b) for _, b in batches), desc="harvest", unit="seq", disable=None)
    for pno, batch in batches:
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            log(f"harvest: time budget {time_budget:.0f}s reached")
            break
        ps = passes[pno]
        idx = [i for i, _, _ in batch]
        b = len(batch)
        plen = torch.tensor([len(ids) for _, ids, _ in batch], device=device)
        pmin, pmax = min(len(ids) for _, ids, _ in batch), max(len(ids) for _, ids, _ in batch)
        seq = torch.zeros(b, pmax + max_new_tokens, dtype=torch.long, device=device)
        for r, (_, ids, _) in enumerate(batch):
            seq[r, : len(ids)] = torch.tensor(ids, device=device)
        u = None if ps.greedy else sample_uniforms(seed, pno, [k for _, _, k in batch], seq.shape[1]).to(device)
        logits, hid = model.forward(seq[:, :pmin], 0, return_hidden=True)
        hiddens = [hid[:, -1]]  # hidden at position pmin - 1 + j is hiddens[j]
        logits = logits[:, -1]
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        eos_pos = torch.full((b,), -1, dtype=torch.long, device=device)
        last = pmax + max_new_tokens - 1  # the last position any row needs a token at
        for pos in range(pmin, last + 1):
            if ps.greedy:
                chosen = torch.argmax(logits, -1)
            else:
                chosen = sample_rows(logits, ps.temperature, ps.top_p, u[:, pos])
            generated = pos >= plen
            tok_now = torch.where(generated, chosen, seq[:, pos])
            seq[:, pos] = tok_now
            new_eos = generated & ~finished & torch.isin(tok_now, eos)
            eos_pos = torch.where(new_eos, pos, eos_pos)
            finished |= new_eos | (pos >= plen + max_new_tokens - 1)
            if pos == last or bool(finished.all()):
                break  # a finished row's last token needs no hidden state: it predicts nothing kept
            logits, hid = model.forward(tok_now[:, None], pos, return_hidden=True)
            hiddens.append(hid[:, 0])
            logits = logits[:, 0]
        hiddens = torch.stack(hiddens, 1)  # [b, steps, H]
        n = max_new_tokens + 1
        tokens = torch.zeros(b, n, dtype=torch.int32)
        hidden = torch.zeros(b, n, hiddens.shape[-1], dtype=torch.bfloat16)  # (H, or more: Transformer.hidden_layers)
        lengths = []
        for r in range(b):
            p = int(plen[r])  # region index 0 is position p - 1
            ln = max_new_tokens if int(eos_pos[r]) < 0 else int(eos_pos[r]) - p + 1
            lengths.append(ln)
            tokens[r, : ln + 1] = seq[r, p - 1: p + ln].to("cpu", torch.int32)
            hidden[r, :ln] = hiddens[r, p - pmin: p - pmin + ln].to("cpu", torch.bfloat16)
        shard = out / f"shard_{shard_no:05d}.safetensors"
        groups = [_group_key(prompts[i], i) for i in idx]
        kinds = [ALL_KINDS.index(prompts[i]["kind"]) if prompts[i].get("kind") in ALL_KINDS else -1 for i in idx]
        save_file({"tokens": tokens, "hidden": hidden, "lengths": torch.tensor(lengths, dtype=torch.int32),
                   "prompt_index": torch.tensor(idx, dtype=torch.int32),
                   "prompt_key": torch.tensor([k for _, _, k in batch], dtype=torch.int64),
                   "pass": torch.full((b,), pno, dtype=torch.int32),
                   "group": torch.tensor(groups, dtype=torch.int32),
                   "kind": torch.tensor(kinds, dtype=torch.int32)}, str(shard),
                  metadata={k: str(v) for k, v in {**meta, "pass": pno, "temperature": ps.temperature,
                                                   "top_p": ps.top_p, "seed": seed}.items()})
        shard_no += 1
        written += b
        bar.update(b)
    bar.close()
    dt = time.perf_counter() - t0
    log(f"harvest: {written} sequences in {dt:.1f}s -> {out} ({len(done) + written} in total)")
    return written


def load_harvest(data_dir: str | Path, target_cfg=None) -> HarvestData:
    """All shards of a harvest directory. ``meta`` is the last shard's metadata plus 'passes' (per
    pass: temperature, top_p, seed, sequences) and 'prompt_set' (the sets harvested, '+'-joined)."""
    from safetensors import safe_open

    d = Path(data_dir)
    shards = sorted(d.glob("shard_*.safetensors"))
    if not shards:
        raise DraftError(f"{d}: no harvest shards (shard_*.safetensors); run `flint draft harvest` first")
    parts = {"tokens": [], "hidden": [], "lengths": [], "prompt_index": [], "group": [], "kind": [],
             "pass": [], "temperature": []}
    meta, passes, sets = {}, {}, set()
    for sh in shards:
        with safe_open(str(sh), framework="pt") as fh:
            meta = fh.metadata() or {}
            if target_cfg is not None and meta.get("fingerprint") != target_fingerprint(target_cfg):
                raise DraftError(f"{sh}: harvested from target {meta.get('target')!r} "
                                 f"(fingerprint {meta.get('fingerprint')}), not this target "
                                 f"{target_cfg.name!r}")
            for k in ("tokens", "hidden", "lengths", "prompt_index", "group", "kind"):
                parts[k].append(fh.get_tensor(k))
            pno, ps, pseed = _shard_pass(meta)
            n = parts["lengths"][-1].shape[0]
            parts["pass"].append(fh.get_tensor("pass") if "pass" in fh.keys()
                                 else torch.full((n,), pno, dtype=torch.int32))
            parts["temperature"].append(torch.full((n,), ps.temperature))
            rec = passes.setdefault(pno, {"pass": pno, "temperature": ps.temperature, "top_p": ps.top_p,
                                          "seed": None if ps.greedy else pseed, "sequences": 0})
            if (rec["temperature"], rec["top_p"]) != (ps.temperature, ps.top_p):
                raise DraftError(f"{sh}: pass {pno} at temperature {ps.temperature}, top_p {ps.top_p}; another "
                                 f"shard of {d} has it at {rec['temperature']}, {rec['top_p']}")
            rec["sequences"] += n
            sets.add(meta.get("prompt_set", "?"))
    cat = {k: torch.cat(v) for k, v in parts.items()}
    meta = {**meta, "prompt_set": "+".join(sorted(sets)), "passes": [passes[k] for k in sorted(passes)]}
    return HarvestData(cat["tokens"].long(), cat["hidden"], cat["lengths"].long(), cat["prompt_index"].long(),
                       meta, cat["group"].long(), cat["kind"].long(), cat["pass"].long(), cat["temperature"])


def rank_vocab(data: HarvestData, vocab_size: int) -> tuple[torch.Tensor, dict]:
    """All token ids ranked by how often the target generated them in the harvest (most frequent
    first; ties and tokens never generated in id order), and a summary. The first N are the
    drafting vocabulary of size N."""
    n = data.tokens.shape[1]
    gen = (torch.arange(n)[None, :] >= 1) & (torch.arange(n)[None, :] <= data.lengths.cpu()[:, None])
    toks = data.tokens.cpu()[gen]
    if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= vocab_size):
        raise DraftError(f"harvest: a token id outside the target's vocabulary (size {vocab_size})")
    counts = torch.bincount(toks, minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices
    cum = counts[order].cumsum(0).double() / max(int(counts.sum()), 1)
    cover = {str(m): round(float(cum[m - 1]), 5) for m in (1024, 2048, 4096, 8192, 16384, 32768) if m <= vocab_size}
    harvest = {k: data.meta.get(k) for k in ("prompt_set", "max_new_tokens", "passes") if k in data.meta}
    return order, {"harvest": {**harvest, "sequences": int(data.tokens.shape[0])},
                   "tokens_counted": int(counts.sum()), "distinct": int((counts > 0).sum()), "coverage": cover}
