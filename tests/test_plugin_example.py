"""The example of a test written with the harness's pytest plugin, in docs/writing-tests.md.

Kept identical to that page's block (tests/test_pytest_plugin.py checks that), so the suite runs it.
"""

import pytest

from harness.model import ServerParams

PROMPT = tuple(1 + (i * 7) % 23 for i in range(48))


@pytest.mark.prompt_cache_invariants
def test_a_returning_prompt_resumes_from_the_cache(modelled_server):
    server = modelled_server("shared", "hybrid", params=ServerParams(n_slots=1))
    for prompt in (PROMPT, (50,) * 40, (*PROMPT, 7, 8)):  # the second prompt pushes the first into the cache
        server.handle_completion(prompt, n_predict=2)
        server.run_until_idle()
    assert server.slots[0].n_prompt_cached >= 40  # resumed from the cache entry, not from scratch
