"""`ArraySource` and `SourceDataset`: the source protocol over arrays, views,
index checks, and the dataset of two sources."""

import numpy as np
import pytest

from dpfl_tf.data import ArraySource, DataSource, SourceDataset


def test_array_source_protocol_and_views():
    x = np.arange(6 * 4, dtype=np.float32).reshape(6, 2, 2)
    y = np.array([0, 1, 2, 0, 1, 2], dtype=np.uint8)
    source = ArraySource(x, y)
    assert len(source) == 6 and source.element_shape == (2, 2) and source.dtype == np.float32
    image, label = source[4]
    np.testing.assert_array_equal(image, x[4])
    assert label == 1 and type(label) is int
    xb, yb = source.__getitems__([5, 0, 5, -6])
    np.testing.assert_array_equal(xb, x[[5, 0, 5, 0]])
    assert yb.tolist() == [2, 0, 2, 0] and yb.dtype == np.int64
    view = source.subset(np.array([5, 1, 3]))
    np.testing.assert_array_equal(view.to_arrays(batch_size=2)[0], x[[5, 1, 3]])
    assert view.labels.tolist() == [2, 1, 0]
    inner = view.subset([2, 0])  # a view of a view
    np.testing.assert_array_equal(inner.__getitems__([0, 1])[0], x[[3, 5]])
    assert inner[0][1] == 0 and len(source) == 6  # the parent is unchanged
    for bad in ([6], [0, -7]):
        with pytest.raises(IndexError, match="out of range for a source of 6 records"):
            source.__getitems__(bad)
    with pytest.raises(TypeError, match="indices must be a 1-D sequence of integers"):
        source.__getitems__([0.5])
    with pytest.raises(TypeError, match="indexed by one integer"):
        source["a"]
    with pytest.raises(ValueError, match="x has 5 records but y has 6 labels"):
        ArraySource(x[:5], y)
    with pytest.raises(ValueError, match="labels must be 1-D integer class indices"):
        ArraySource(x, y.astype(np.float32))


def test_source_dataset_checks_its_labels():
    train = ArraySource(np.zeros((4, 3), np.uint8), [0, 1, 2, 1])
    test = ArraySource(np.zeros((2, 3), np.uint8), [2, 0])
    where = DataSource("toy", "/nowhere", "npz")
    data = SourceDataset(
        train, test, num_classes=3, class_names=("a", "b", "c"), name="toy", source=where
    )
    assert data.y_train.tolist() == [0, 1, 2, 1] and data.y_test.tolist() == [2, 0]
    assert data.input_shape == (3,) and "ArraySource(4 records" in repr(data)
    with pytest.raises(ValueError, match=r"test labels must lie in \[0, 2\), got \[0, 2\]"):
        SourceDataset(
            train.subset([0, 1]),
            test,
            num_classes=2,
            class_names=("a", "b"),
            name="toy",
            source=where,
        )
    with pytest.raises(ValueError, match="class_names must have num_classes=3 entries"):
        SourceDataset(train, test, num_classes=3, class_names=("a",), name="toy", source=where)
