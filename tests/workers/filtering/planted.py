"""Planted secrets and addresses (well-formed, none real) for the output-filter tests."""

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"  # AWS's documentation example key id
GITHUB_TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
OPENAI_KEY = "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5q" + "T3BlbkFJ" + "Zy8xWv7uTs6rQp5oNm4l"
SLACK_TOKEN = "xoxb-" + "123456789012-1234567890123-" + "AbCdEfGhIjKlMnOpQrStUvWx"
EMAIL = "alice.smith@example.com"

SECRETS = {"aws-access-key": AWS_KEY, "github-token": GITHUB_TOKEN,
           "openai-token": OPENAI_KEY, "slack-token": SLACK_TOKEN, "email": EMAIL}

LEAKY = (f"Use the key {AWS_KEY} with token {GITHUB_TOKEN}; the OpenAI key is {OPENAI_KEY}. "
         f"Questions to {EMAIL}.")
CLEAN = "The sum of 17 and 25 is 42; sorted([3, 1, 2]) == [1, 2, 3]. See section 4.2."
