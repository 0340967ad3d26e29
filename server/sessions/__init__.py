"""Conversations: the session store (store.py) and a conversation (conversation.py), their
spill files (spill.py) and which replica owns one (claims.py)."""
