"""The ImageNet ResNet-50 recipe as an hvdtrain job: a published recipe is a preset of flags.

Goyal et al. 2017 ("Accurate, Large Minibatch SGD") with the refinements torchvision and timm
train with: SGD with Nesterov momentum 0.9, weight decay on the weights but not on biases and
batch-norm parameters, label smoothing 0.1, the rate scaled linearly with the global batch
(0.1 per 256 images) and warmed up over 5 epochs, then divided by 10 at epochs 30, 60 and 80 of
90; here also early stopping when the validation loss stalls for 10 epochs.

    horovodrun -np 8 python examples/resnet_recipe.py --data-dir /data/imagenet/train --augment
    horovodrun -np 2 python examples/resnet_recipe.py --preset tiny    # the digits, seconds

Every flag of `python -m hvdtrain.cnn` works (--help); the run directory, checkpoints, resume and
preemption are hvdtrain's. The recipe means the same on 1 rank and on 64: horovod averages the
gradients before the optimizer sees them (decay and momentum act on the average), the rate
follows the global batch, and the milestones are epochs.

Weight decay: Keras' is decoupled (each step a weight shrinks by rate x decay, outside the
momentum), the paper's is an L2 term whose shrink goes through the momentum and so is 1 / (1 -
0.9) = 10 times larger in the long run: its 1e-4 is about a decoupled 1e-3, this preset's value.
"""
import hvdtrain  # first: it selects the Keras (Keras 3; tf_keras with HVDTRAIN_KERAS=2)

from hvdtrain.cnn import ClassifierConfig, classifier  # noqa: E402


def default() -> ClassifierConfig:
    """ResNet-50 on an image folder (--data-dir, with --augment for photos): 90 epochs, 32
    images per GPU."""
    return ClassifierConfig(
        model="resnet50", image_size=224, epochs=90, batch_size=32,
        learning_rate=0.1 * 32 / 256, lr_scaling="linear", warmup_epochs=5,
        lr_decay="step", lr_milestones="30,60,80", lr_gamma=0.1,
        optimizer="sgd", momentum=0.9, nesterov=True, weight_decay=1e-3,
        label_smoothing=0.1, early_stopping=10, run_dir="runs/resnet-recipe")


def tiny() -> ClassifierConfig:
    """The same recipe on the embedded digits with hvdtrain's small CNN, in seconds."""
    return ClassifierConfig(
        model="cnn", epochs=4, batch_size=32, learning_rate=0.05, warmup_epochs=1,
        lr_decay="step", lr_milestones="2,3", lr_gamma=0.1,
        optimizer="sgd", momentum=0.9, nesterov=True, weight_decay=1e-3,
        label_smoothing=0.1, early_stopping=2, tensorboard=False,
        run_dir="runs/resnet-recipe-tiny")


if __name__ == "__main__":
    hvdtrain.main(lambda config: classifier(config.model, config.label_smoothing),
                  name="resnet-recipe", presets={"default": default, "tiny": tiny})
