"""What runs inside a training and inside a fill job: the DeepSpeed hook (``hook``, its GPU timing in
``gpu_timing``, memory probes in ``probes``) and the fill-job runtime (``sdk``, its gating decisions in ``gating``).

Their public faces are ``bubbles.hook`` (``instrument``) and ``bubbles.sdk`` (what a fill job imports); the code
behind them is here and may move between releases. torch is imported only inside the functions that need it, and
DeepSpeed never: these modules run in the user's processes, next to whatever versions those bring."""
