"""Make the small local assets torchtitan's llama3 debugmodel reads (no download):

<out>/tokenizer/{tokenizer.json,tokenizer_config.json}: a byte-level BPE of at most 2000 tokens
(the debugmodel's vocabulary is 2048) trained on the generated text;
<out>/c4_test/c4_test.json: json lines {"text": ...} of deterministic pseudo-English.
"""
import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = sys.argv[1]
os.makedirs(os.path.join(out, "tokenizer"), exist_ok=True)
os.makedirs(os.path.join(out, "c4_test"), exist_ok=True)
rng = random.Random(0)
words = ["the", "model", "shard", "tensor", "parallel", "data", "mesh", "rank", "gradient", "loss", "step",
         "attention", "layer", "token", "weight", "sum", "a", "of", "to", "in", "is", "and", "on", "with",
         "train", "device", "expert", "sequence", "context", "pipeline", "stage", "batch", "norm", "head"]
docs = []
for i in range(2000):
    n = rng.randint(40, 400)
    docs.append(" ".join(rng.choice(words) + ("." if rng.random() < 0.08 else "") for _ in range(n)))
with open(os.path.join(out, "c4_test", "train.json"), "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(docs, trainer)
tok.save(os.path.join(out, "tokenizer", "tokenizer.json"))
with open(os.path.join(out, "tokenizer", "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
               "add_eos_token": True}, f)
print("assets in", out, "vocab", tok.get_vocab_size())
