import pytest
import torch
import torch.nn.functional as F

from ds_compress import distillation_loss, init_compression


def _lr(teacher_layer, others=()):
    return {"layer_reduction": {"enabled": True, "keep_number_layer": len(teacher_layer),
                                "module_name_prefix": "layer", "teacher_layer": teacher_layer,
                                "other_module_name": list(others)}}


def test_student_layers_copied_from_chosen_teacher_layers(make_encoder):
    torch.manual_seed(0)
    teacher = make_encoder(layers=4)
    student = make_encoder(layers=2)
    init_compression(student, _lr([1, 3], ["embeddings", "classifier"]), teacher_model=teacher)
    for i, t in enumerate([1, 3]):
        for (name, p), (tname, tp) in zip(student.layer[i].state_dict().items(),
                                          teacher.layer[t].state_dict().items(), strict=True):
            assert name == tname
            torch.testing.assert_close(p, tp)
    torch.testing.assert_close(student.embeddings.weight, teacher.embeddings.weight)
    torch.testing.assert_close(student.classifier.weight, teacher.classifier.weight)
    # the copy is independent of the teacher
    with torch.no_grad():
        student.layer[0].intermediate.dense.weight.add_(1)
    assert not torch.equal(student.layer[0].intermediate.dense.weight, teacher.layer[1].intermediate.dense.weight)


def test_student_with_too_many_layers_is_cut(make_encoder):
    torch.manual_seed(0)
    teacher, student = make_encoder(layers=4), make_encoder(layers=4)
    init_compression(student, _lr([0, 2]), teacher_model=teacher)
    assert len(student.layer) == 2
    torch.testing.assert_close(student.layer[1].output.dense.weight, teacher.layer[2].output.dense.weight)


def test_without_teacher_the_model_keeps_its_own_layers(make_encoder):
    torch.manual_seed(0)
    model = make_encoder(layers=4)
    originals = [model.layer[i] for i in (3, 1)]
    init_compression(model, _lr([3, 1]))
    assert len(model.layer) == 2 and model.layer[0] is originals[0] and model.layer[1] is originals[1]


def test_bad_teacher_index_names_key(make_encoder):
    with pytest.raises(ValueError, match=r"teacher_layer \[0, 7\] has indices \[7\]"):
        init_compression(make_encoder(layers=2), _lr([0, 7]), teacher_model=make_encoder(layers=4))
    with pytest.raises(ValueError, match="other_module_name"):
        init_compression(make_encoder(layers=2), _lr([0, 1], ["pooler"]), teacher_model=make_encoder(layers=4))


def test_distillation_loss_reference():
    torch.manual_seed(0)
    s, t = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5)
    temperature = 2.0
    p = torch.softmax(t / temperature, -1)
    expected = (p * (p.log() - torch.log_softmax(s / temperature, -1))).sum(-1).mean() * temperature ** 2
    loss = distillation_loss(s, t, temperature)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert s.grad is not None and distillation_loss(t, t).abs().item() < 1e-6


def test_layer_reduction_with_kd_trains_student(make_encoder):
    """A 1-layer student initialised from layer 1 of a 2-layer teacher learns to match it by KD."""
    torch.manual_seed(0)
    teacher = make_encoder(layers=2).eval()
    student = init_compression(make_encoder(layers=1), _lr([1], ["embeddings", "classifier"]), teacher_model=teacher)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    ids = torch.randint(0, 32, (64, 6))
    with torch.no_grad():
        target = teacher(ids)
    first = distillation_loss(student(ids), target).item()
    for _ in range(40):
        loss = distillation_loss(student(ids), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first
    assert F.softmax(student(ids), -1).argmax(-1).eq(target.argmax(-1)).float().mean() > 0.8
