"""Planning before spending GPU-hours: memory per GPU, parallel layout, budget, checkpoint interval.

    hpctrain plan memory --model 8b --strategy fsdp --gpus 4 --ac full --micro-batch 2
    hpctrain plan interval --save-min 5 --mttf-h 24
"""
