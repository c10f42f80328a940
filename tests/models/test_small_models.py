"""Tests for ToyModel and ConvNet: the layer layout the examples rely on, and output shapes."""

import pytest
import torch
from torch import nn

from ddpkit.models.convnet import ConvNet
from ddpkit.models.toy import ToyModel


def test_toy_model_layers_and_shape():
    model = ToyModel()
    assert (model.net1.in_features, model.net1.out_features) == (10, 10)
    assert (model.net2.in_features, model.net2.out_features) == (10, 5)
    assert model(torch.randn(4, 10)).shape == (4, 5)


def test_toy_model_applies_relu_between_layers():
    model = ToyModel()
    x = torch.randn(6, 10)
    expected = model.net2(torch.relu(model.net1(x)))
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize(("image_size", "fc_in"), [(28, 7 * 7 * 32), (8, 2 * 2 * 32)])
def test_convnet_shapes(image_size, fc_in):
    model = ConvNet(num_classes=10, image_size=image_size)
    assert model.fc.in_features == fc_in
    out = model(torch.randn(3, 1, image_size, image_size))
    assert out.shape == (3, 10)


def test_convnet_layer_layout():
    model = ConvNet()
    kinds = [type(m) for m in model.layer1]
    assert kinds == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d]
    assert (model.layer1[0].out_channels, model.layer2[0].out_channels) == (16, 32)
    assert model.layer1[0].kernel_size == (5, 5) and model.layer1[0].padding == (2, 2)


def test_convnet_training_updates_batchnorm_buffers():
    model = ConvNet(image_size=8)
    before = model.layer1[1].running_mean.clone()
    model(torch.randn(4, 1, 8, 8) + 3.0)
    assert not torch.equal(before, model.layer1[1].running_mean)


@pytest.mark.parametrize("image_size", [0, 6, 30])
def test_convnet_rejects_image_size_not_multiple_of_four(image_size):
    with pytest.raises(ValueError, match=f"got {image_size}"):
        ConvNet(image_size=image_size)


def test_convnet_rejects_zero_classes():
    with pytest.raises(ValueError, match="num_classes"):
        ConvNet(num_classes=0)
