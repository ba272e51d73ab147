"""The simulator tokenizes exactly like the router: one implementation in ``infera.kv.tokenizer``."""
from infera.kv.tokenizer import *  # noqa: F401,F403
from infera.kv.tokenizer import (BuiltinTokenizer, ChatTemplateError, HFTokenizer, SimTokenizer,  # noqa: F401
                                 content_to_text, load_tokenizer, normalize_messages)
