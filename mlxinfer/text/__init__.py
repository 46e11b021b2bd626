"""Text in and out, around the model: the tokenizer and its chat template (rendered in a sandbox),
images made into the model's inputs (and fetched, where allowed), the reply's thinking told apart
from its answer, tool calls, and the constraints that hold a reply to a format."""
