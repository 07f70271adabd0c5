import numpy as np
import pytest

from edgefcl.outcomes.metrics import CommStats, forgetting, last_accuracy, per_task_final


def test_accuracy_and_forgetting_by_hand():
    # one client, three tasks; rows: after task t, columns: task i
    acc = np.array([[[0.9, 0.0, 0.0],
                     [0.6, 0.8, 0.0],
                     [0.5, 0.4, 0.7]]])
    assert last_accuracy(acc) == pytest.approx((0.5 + 0.4 + 0.7) / 3)
    # task 0: best before last = 0.9, final 0.5 -> 0.4; task 1: best 0.8, final 0.4 -> 0.4
    assert forgetting(acc) == pytest.approx(0.4)
    np.testing.assert_allclose(per_task_final(acc), [0.5, 0.4, 0.7])


def test_metrics_average_over_clients():
    a = np.array([[[1.0, 0.0], [0.5, 1.0]],
                  [[0.8, 0.0], [0.8, 0.6]]])
    assert last_accuracy(a) == pytest.approx(((0.5 + 1.0) / 2 + (0.8 + 0.6) / 2) / 2)
    assert forgetting(a) == pytest.approx((0.5 + 0.0) / 2)


def test_single_task_has_no_forgetting():
    assert forgetting(np.ones((2, 1, 1))) == 0.0


def test_comm_stats_totals():
    c = CommStats()
    c.sent("a", 10)
    c.sent("a", 5)
    c.sent("b", 1)
    c.received("a", 7)
    assert c.bytes_up == 16 and c.bytes_down == 7
    assert c.to_dict()["bytes_up_per_client"] == {"a": 15, "b": 1}
