"""Built-in tasks a config names with ``task:`` and configures with ``task_args:``.

    task: hpctrain.tasks.images:classifier
    task_args: {model: resnet50, data: /scratch/imagenet-shards, image_size: 224}
"""
