"""A pytest plugin for bench/sanitize.sh (``-p sanitize_plugin`` with ``bench`` on the path):
registers the Hypothesis profile ``sanitize`` before tests/conftest.py loads the profile that
``HYPOTHESIS_PROFILE`` names. A few derandomized examples per property: under racecheck a
kernel runs ~100x slower and every new kernel specialisation a drawn case reaches is compiled
and instrumented, so examples are what the time budget is spent on.
"""
from hypothesis import settings

#: examples per property test under the sanitizer
EXAMPLES = 4

settings.register_profile("sanitize", max_examples=EXAMPLES, derandomize=True, deadline=None,
                          print_blob=True)
