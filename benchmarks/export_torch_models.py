"""Export PyTorch models (random weights, no downloads) to ONNX with dynamic axes.

    pip install torch transformers          # not cannc dependencies
    python benchmarks/export_torch_models.py OUT_DIR [bert minilm gpt2 resnet18 mobilenet]
    pip install torchvision; python benchmarks/export_torch_models.py OUT_DIR more
    python benchmarks/run_zoo.py --onnx OUT_DIR/*.onnx

bert: Hugging Face BertModel at BERT-base size (eager attention, padding mask),
inputs input_ids/attention_mask [batch, seq]; minilm: a sentence-transformer encoder
at all-MiniLM-L6-v2's size (BertModel, hidden 384, 6 layers, 12 heads,
intermediate 1536) with the masked mean pooling of sentence-transformers, output
the sentence embedding [batch, 384]; gpt2: a GPT-2-small-sized decoder
written with F.scaled_dot_product_attention(is_causal=True); resnet18 and
mobilenet: torchvision's architectures written out in plain torch (dynamic
batch, 224x224, BatchNorm statistics randomised). torch.onnx's TorchScript
exporter, opset 17. These are the "models this repository does not contain"
the issue measures against; the files are big (bert 418 MiB) and not committed.
"more" (see the end of the file) exports a second set: nine torchvision CNNs and
transformers (resnet50, efficientnet_b0, mobilenet_v3 large, convnext_tiny,
shufflenet v2, regnet_y_800mf, vit_b16, squeezenet 1.1, densenet121) and two Hugging
Face encoders (distilbert, a T5-small-sized encoder); "third" a third set of sixteen
torchvision models (THIRD_VISION at the end of the file); "hf" eight Hugging Face
architectures (HF_TEXT, HF_VISION at the end of the file); "dynamo" nineteen models exported
with torch.onnx.export's defaults (the dynamo exporter; DYNAMO_TEXT, DYNAMO_VISION, DYNAMO_HF).
"""
import os
import sys
import warnings

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")
torch.manual_seed(0)
out = sys.argv[1] if len(sys.argv) > 1 else "build/torch"
which = sys.argv[2:] or ["bert", "minilm", "gpt2", "resnet18", "mobilenet"]
os.makedirs(out, exist_ok=True)

def export(model, args, names, dyn, path, opset=17, dynamo=False):
    model.eval()
    torch.onnx.export(model, args, path, input_names=names, output_names=["out"],
                      dynamic_axes=dyn, opset_version=opset, dynamo=dynamo)
    print("wrote", path)

if "bert" in which:
    from transformers import BertConfig, BertModel
    cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, attn_implementation="eager")
    m = BertModel(cfg)
    class W(torch.nn.Module):
        def __init__(s, m):
            super().__init__()
            s.m = m
        def forward(s, ids, mask): return s.m(input_ids=ids, attention_mask=mask).last_hidden_state
    ids = torch.randint(0, 30000, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.int64)
    export(W(m), (ids, mask), ["input_ids", "attention_mask"],
           {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "out": {0: "batch", 1: "seq"}},
           f"{out}/bert_base.onnx")
if "minilm" in which:
    from transformers import BertConfig, BertModel
    cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                     intermediate_size=1536, attn_implementation="eager")
    m = BertModel(cfg)
    class MeanPool(torch.nn.Module):
        """sentence-transformers' Pooling(mean): the token embeddings averaged over the mask."""
        def __init__(s, m):
            super().__init__()
            s.m = m
        def forward(s, ids, mask):
            h = s.m(input_ids=ids, attention_mask=mask).last_hidden_state
            w = mask.unsqueeze(-1).to(h.dtype)
            return (h * w).sum(1) / w.sum(1).clamp(min=1e-9)
    ids = torch.randint(0, 30000, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.int64)
    export(MeanPool(m), (ids, mask), ["input_ids", "attention_mask"],
           {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "out": {0: "batch"}},
           f"{out}/minilm.onnx")
class GPTBlock(torch.nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.h = h
        s.ln1 = torch.nn.LayerNorm(d)
        s.qkv = torch.nn.Linear(d, 3 * d)
        s.proj = torch.nn.Linear(d, d)
        s.ln2 = torch.nn.LayerNorm(d)
        s.fc = torch.nn.Linear(d, 4 * d)
        s.out = torch.nn.Linear(4 * d, d)
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, s.h, C // s.h).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + s.out(torch.nn.functional.gelu(s.fc(s.ln2(x)), approximate="tanh"))
class GPT2(torch.nn.Module):
    def __init__(s, V=50257, P=1024, d=768, L=12, h=12):
        super().__init__()
        s.wte = torch.nn.Embedding(V, d)
        s.wpe = torch.nn.Embedding(P, d)
        s.blocks = torch.nn.ModuleList(GPTBlock(d, h) for _ in range(L))
        s.ln = torch.nn.LayerNorm(d)
    def forward(s, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = s.wte(ids) + s.wpe(pos)
        for b in s.blocks:
            x = b(x)
        return s.ln(x)
if "gpt2" in which:
    export(GPT2(), (torch.randint(0, 50000, (1, 128)),), ["input_ids"],
           {"input_ids": {0: "batch", 1: "seq"}, "out": {0: "batch", 1: "seq"}}, f"{out}/gpt2.onnx")
class Block(nn.Module):
    def __init__(s, cin, cout, stride):
        super().__init__()
        s.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        s.b1 = nn.BatchNorm2d(cout)
        s.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        s.b2 = nn.BatchNorm2d(cout)
        s.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
    def forward(s, x):
        y = torch.relu(s.b1(s.c1(x)))
        y = s.b2(s.c2(y))
        return torch.relu(y + (x if s.down is None else s.down(x)))
class ResNet18(nn.Module):
    def __init__(s):
        super().__init__()
        s.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, st in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [Block(cin, cout, st), Block(cout, cout, 1)]
            cin = cout
        s.layers = nn.Sequential(*layers)
        s.fc = nn.Linear(512, 1000)
    def forward(s, x):
        return s.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(s.layers(s.stem(x)), 1), 1))
class IR(nn.Module):
    def __init__(s, cin, cout, stride, t):
        super().__init__()
        h = cin * t
        s.res = stride == 1 and cin == cout
        L = [] if t == 1 else [nn.Conv2d(cin, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6()]
        L += [nn.Conv2d(h, h, 3, stride, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
              nn.Conv2d(h, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        s.f = nn.Sequential(*L)
    def forward(s, x): return x + s.f(x) if s.res else s.f(x)
class MobileNetV2(nn.Module):
    def __init__(s):
        super().__init__()
        L = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6()]
        cin = 32
        for t, c, n, st in [(1,16,1,1),(6,24,2,2),(6,32,3,2),(6,64,4,2),(6,96,3,1),(6,160,3,2),
                            (6,320,1,1)]:
            for i in range(n):
                L.append(IR(cin, c, st if i == 0 else 1, t))
                cin = c
        L += [nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6()]
        s.f = nn.Sequential(*L)
        s.fc = nn.Linear(1280, 1000)
    def forward(s, x): return s.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(s.f(x), 1), 1))
def _randbn(m):
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.1, 0.1)
            mod.running_var.uniform_(0.5, 1.5)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.uniform_(-0.1, 0.1)
    return m
if "resnet18" in which:
    export(_randbn(ResNet18()), (torch.randn(1, 3, 224, 224),), ["x"],
           {"x": {0: "batch"}, "out": {0: "batch"}}, f"{out}/resnet18.onnx")
if "mobilenet" in which:
    export(_randbn(MobileNetV2()), (torch.randn(1, 3, 224, 224),), ["x"],
           {"x": {0: "batch"}, "out": {0: "batch"}}, f"{out}/mobilenet_v2.onnx")

# The second set (`... OUT_DIR more`, or any of its names): torchvision's own definitions
# (pip install torchvision; random weights, no downloads) and three more Hugging Face
# encoders. torchvision's C++ operators are not needed for these models; a torchvision
# wheel built for another torch build fails registering them at import, so that
# registration is skipped.
MORE_VISION = {"resnet50": "resnet50", "efficientnet_b0": "efficientnet_b0",
               "mobilenet_v3": "mobilenet_v3_large", "convnext_tiny": "convnext_tiny",
               "shufflenet": "shufflenet_v2_x1_0", "regnet": "regnet_y_800mf",
               "vit_b16": "vit_b_16", "squeezenet": "squeezenet1_1",
               "densenet121": "densenet121"}
MORE_TEXT = ["distilbert", "t5_encoder"]
if "more" in which:
    which += list(MORE_VISION) + MORE_TEXT
if any(k in which for k in MORE_VISION):
    torch.library.register_fake = lambda *a, **k: (lambda f: f)
    import torchvision
    for name, fn in MORE_VISION.items():
        if name in which:
            export(_randbn(getattr(torchvision.models, fn)(weights=None)),
                   (torch.randn(1, 3, 224, 224),), ["x"], {"x": {0: "batch"}, "out": {0: "batch"}},
                   f"{out}/{name}.onnx")


class _Encoder(torch.nn.Module):
    def __init__(s, m):
        super().__init__()
        s.m = m
    def forward(s, ids, mask): return s.m(input_ids=ids, attention_mask=mask).last_hidden_state


_TEXT_AXES = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
              "out": {0: "batch", 1: "seq"}}
if "distilbert" in which:
    from transformers import DistilBertConfig, DistilBertModel
    export(_Encoder(DistilBertModel(DistilBertConfig(attn_implementation="eager"))),
           (torch.randint(0, 30000, (1, 128)), torch.ones(1, 128, dtype=torch.int64)),
           ["input_ids", "attention_mask"], _TEXT_AXES, f"{out}/distilbert.onnx")
if "t5_encoder" in which:
    from transformers import T5Config, T5EncoderModel
    cfg = T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128)
    export(_Encoder(T5EncoderModel(cfg)),
           (torch.randint(0, 30000, (1, 128)), torch.ones(1, 128, dtype=torch.int64)),
           ["input_ids", "attention_mask"], _TEXT_AXES, f"{out}/t5_encoder.onnx")

# The third set (`... OUT_DIR third`, or any of its names): more torchvision architectures,
# for the paths the first two sets do not take: grouped (ResNeXt, RegNetX) and wide convs,
# inception branches, dilated convs (DeepLabV3's ASPP), a segmentation head with a
# bilinear Resize (LR-ASPP), windowed attention written with Einsum (MaxViT), shifted
# windows (Swin), and the plain VGG / AlexNet stacks.
THIRD_VISION = {
    "resnext50": ("resnext50_32x4d", {}, 224), "wide_resnet50": ("wide_resnet50_2", {}, 224),
    "googlenet": ("googlenet", {"aux_logits": False, "init_weights": True}, 224),
    "inception_v3": ("inception_v3", {"aux_logits": False, "init_weights": True}, 299),
    "mnasnet": ("mnasnet1_0", {}, 224), "mobilenet_v3_small": ("mobilenet_v3_small", {}, 224),
    "efficientnet_v2_s": ("efficientnet_v2_s", {}, 224),
    "regnet_x_400mf": ("regnet_x_400mf", {}, 224), "swin_t": ("swin_t", {}, 224),
    "maxvit_t": ("maxvit_t", {}, 224), "vgg11": ("vgg11", {}, 224),
    "alexnet": ("alexnet", {}, 224), "shufflenet_x2": ("shufflenet_v2_x2_0", {}, 224),
    "squeezenet11": ("squeezenet1_1", {}, 224),
    "deeplabv3_mbv3": ("segmentation.deeplabv3_mobilenet_v3_large",
                       {"weights_backbone": None, "aux_loss": False}, 224),
    "lraspp": ("segmentation.lraspp_mobilenet_v3_large", {"weights_backbone": None}, 224),
}


class _Out(torch.nn.Module):
    """The segmentation models' {'out': ...} as a tensor."""
    def __init__(s, m):
        super().__init__()
        s.m = m
    def forward(s, x):
        y = s.m(x)
        return y["out"] if isinstance(y, dict) else y


if "third" in which:
    which += list(THIRD_VISION)
if any(k in which for k in THIRD_VISION):
    torch.library.register_fake = lambda *a, **k: (lambda f: f)
    import torchvision
    for name, (fn, kw, hw) in THIRD_VISION.items():
        if name in which:
            ctor = torchvision.models
            for part in fn.split("."):
                ctor = getattr(ctor, part)
            export(_Out(_randbn(ctor(weights=None, **kw))), (torch.randn(1, 3, hw, hw),),
                   ["x"], {"x": {0: "batch"}, "out": {0: "batch"}}, f"{out}/{name}.onnx")

# The Hugging Face set (`... OUT_DIR hf`, or any of its names): eight more transformer
# architectures from `transformers` (random weights, eager attention), each exported as
# its base model's last hidden state: encoders with input_ids / attention_mask [batch,
# seq] (RoBERTa, ALBERT, ELECTRA and DeBERTa-v2 with its disentangled attention), and
# CLIP's vision tower, HF's own Swin, wav2vec2 (raw audio [batch, 16000]) and Whisper's
# encoder (log-mel [batch, 80, 3000]) on one input tensor "x".
HF_TEXT = {
    "roberta": ("RobertaConfig", "RobertaModel", {"attn_implementation": "eager"}),
    "albert": ("AlbertConfig", "AlbertModel", {"attn_implementation": "eager"}),
    "electra": ("ElectraConfig", "ElectraModel", {"attn_implementation": "eager"}),
    "deberta": ("DebertaV2Config", "DebertaV2Model",
                {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
                 "intermediate_size": 1536}),
}
HF_VISION = {
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", {"attn_implementation": "eager"},
                    (1, 3, 224, 224)),
    "swin_hf": ("SwinConfig", "SwinModel", {}, (1, 3, 224, 224)),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", {"attn_implementation": "eager"},
                 (1, 16000)),
    "whisper_enc": ("WhisperConfig", "WhisperModel",
                    {"d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6,
                     "decoder_layers": 1, "encoder_ffn_dim": 1536,
                     "attn_implementation": "eager"}, (1, 80, 3000)),
}


class _Hidden(torch.nn.Module):
    """A vision or audio model's last hidden state, from one tensor."""
    def __init__(s, m):
        super().__init__()
        s.m = m
    def forward(s, x): return s.m(x).last_hidden_state


if "hf" in which:
    which += list(HF_TEXT) + list(HF_VISION)
if any(k in which for k in list(HF_TEXT) + list(HF_VISION)):
    import transformers
    for name, (cfg, cls, kw) in HF_TEXT.items():
        if name in which:
            m = getattr(transformers, cls)(getattr(transformers, cfg)(**kw))
            export(_Encoder(m), (torch.randint(0, 1000, (1, 128)),
                                 torch.ones(1, 128, dtype=torch.int64)),
                   ["input_ids", "attention_mask"], _TEXT_AXES, f"{out}/{name}.onnx")
    for name, (cfg, cls, kw, shape) in HF_VISION.items():
        if name in which:
            m = getattr(transformers, cls)(getattr(transformers, cfg)(**kw))
            if name == "whisper_enc":
                m = m.encoder
            export(_Hidden(m), (torch.randn(*shape),), ["x"],
                   {"x": {0: "batch"}, "out": {0: "batch"}}, f"{out}/{name}.onnx")

# The dynamo set (`... OUT_DIR dynamo`): exported with torch.onnx.export's defaults since
# torch 2.9 (the dynamo exporter, opset 20 graphs with LayerNormalization and Gelu ops,
# weights in a .onnx.data file beside each model), dynamic batch (and sequence) as
# torch.export Dims. Needs `pip install onnxscript`. Names carry a "dyn_" prefix: Hugging
# Face BERT-base and GPT-2 (LM head), Llama- and Qwen2-style decoders (RMSNorm, rotary
# embeddings, grouped-query attention, SiLU-gated MLP; 4 layers, hidden 512, vocab
# 32000, logits out), nine torchvision models and six Hugging Face encoders (DYNAMO_HF).
DYNAMO_TEXT = {
    "dyn_bert": ("BertModel", "BertConfig", {}, True),
    "dyn_gpt2": ("GPT2LMHeadModel", "GPT2Config", {}, False),
    "dyn_llama": ("LlamaForCausalLM", "LlamaConfig",
                  {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000},
                  False),
    "dyn_qwen": ("Qwen2ForCausalLM", "Qwen2Config",
                 {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000},
                 False),
}
DYNAMO_VISION = ["resnet18", "mobilenet_v2", "vit_b_16", "efficientnet_b0", "convnext_tiny",
                 "swin_t", "mobilenet_v3_large", "densenet121", "regnet_y_400mf"]
# Hugging Face encoders at transformers' defaults (SDPA attention where the model has it),
# the Hugging Face set's sizes: input_ids / attention_mask, or one tensor "x". (HF's Swin
# and T5's encoder do not export with torch 2.14's dynamo exporter.)
DYNAMO_HF = {
    "dyn_roberta": ("RobertaModel", "RobertaConfig", {}, None),
    "dyn_deberta": ("DebertaV2Model", "DebertaV2Config",
                    {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
                     "intermediate_size": 1536}, None),
    "dyn_vit_hf": ("ViTModel", "ViTConfig", {}, (2, 3, 224, 224)),
    "dyn_clip_vision": ("CLIPVisionModel", "CLIPVisionConfig", {}, (2, 3, 224, 224)),
    "dyn_whisper_enc": ("WhisperModel", "WhisperConfig",
                        {"d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6,
                         "decoder_layers": 1, "encoder_ffn_dim": 1536}, (2, 80, 3000)),
    "dyn_wav2vec2": ("Wav2Vec2Model", "Wav2Vec2Config", {}, (2, 16000)),
}


class _Logits(torch.nn.Module):
    def __init__(s, m):
        super().__init__()
        s.m = m
    def forward(s, ids): return s.m(input_ids=ids).logits


if "dynamo" in which:
    which += list(DYNAMO_TEXT) + [f"dyn_{n}" for n in DYNAMO_VISION] + list(DYNAMO_HF)
if any(k.startswith("dyn_") for k in which):
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=512)

    def export_dynamo(model, args, names, shapes, path):
        model.eval()
        torch.onnx.export(model, args, path, input_names=names, output_names=["out"],
                          dynamic_shapes=shapes)
        print("wrote", path)

    import transformers
    for name, (cls, cfg, kw, encoder) in DYNAMO_TEXT.items():
        if name in which:
            m = getattr(transformers, cls)(getattr(transformers, cfg)(**kw))
            ids = torch.randint(0, 30000, (2, 128))
            if encoder:
                export_dynamo(_Encoder(m), (ids, torch.ones(2, 128, dtype=torch.int64)),
                              ["input_ids", "attention_mask"],
                              ({0: batch, 1: seq}, {0: batch, 1: seq}), f"{out}/{name}.onnx")
            else:
                export_dynamo(_Logits(m), (ids,), ["input_ids"], ({0: batch, 1: seq},),
                              f"{out}/{name}.onnx")
    for name, (cls, cfg, kw, shape) in DYNAMO_HF.items():
        if name in which:
            m = getattr(transformers, cls)(getattr(transformers, cfg)(**kw))
            if shape is None:
                export_dynamo(_Encoder(m), (torch.randint(0, 1000, (2, 128)),
                                            torch.ones(2, 128, dtype=torch.int64)),
                              ["input_ids", "attention_mask"],
                              ({0: batch, 1: seq}, {0: batch, 1: seq}), f"{out}/{name}.onnx")
            else:
                export_dynamo(_Hidden(m.encoder if name == "dyn_whisper_enc" else m),
                              (torch.randn(*shape),), ["x"], ({0: batch},), f"{out}/{name}.onnx")
    if any(f"dyn_{n}" in which for n in DYNAMO_VISION):
        torch.library.register_fake = lambda *a, **k: (lambda f: f)
        import torchvision
        for n in DYNAMO_VISION:
            if f"dyn_{n}" in which:
                export_dynamo(getattr(torchvision.models, n)(weights=None),
                              (torch.randn(2, 3, 224, 224),), ["x"], ({0: batch},),
                              f"{out}/dyn_{n}.onnx")
