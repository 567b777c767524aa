/* Avro binary encoding driven by a compiled schema program (see schemas/avrobin.py for the program's form).
 *
 * read(program, data, pos) -> (value, end): the value at `pos` and where it ends.
 * write(program, value, prefix) -> bytes: `prefix` followed by the value's encoding.
 *
 * Both are strict: any input they do not handle exactly as fastavro does (a type fastavro would coerce, a
 * malformed body, a missing field) raises Unsupported, and the caller takes fastavro's path, which either
 * handles it or raises the error the codec reports.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

enum { OP_NULL, OP_BOOLEAN, OP_INT, OP_LONG, OP_FLOAT, OP_DOUBLE, OP_BYTES, OP_STRING,
       OP_RECORD, OP_ENUM, OP_ARRAY, OP_MAP, OP_UNION, OP_FIXED };

static PyObject *Unsupported;  /* ValueError subclass */
static PyObject *empty_tuple;

#define OP(prog) ((int)PyLong_AsLong(PyTuple_GET_ITEM((prog), 0)))
#define ARG(prog, i) PyTuple_GET_ITEM((prog), (i))

static int fail(const char *what) {
    PyErr_SetString(Unsupported, what);
    return -1;
}

/* ---- reading ------------------------------------------------------------------------------------ */

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} Reader;

static int read_long(Reader *r, int64_t *out) {
    uint64_t n = 0;
    int shift = 0;
    while (1) {
        if (r->p >= r->end) return fail("truncated varint");
        unsigned char b = *r->p++;
        n |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) break;
        shift += 7;
        if (shift > 63) return fail("varint longer than 10 bytes");
    }
    *out = (int64_t)(n >> 1) ^ -(int64_t)(n & 1);
    return 0;
}

static int read_length(Reader *r, Py_ssize_t *out) {
    int64_t n;
    if (read_long(r, &n) < 0) return -1;
    if (n < 0 || n > (int64_t)(r->end - r->p)) return fail("length out of range");
    *out = (Py_ssize_t)n;
    return 0;
}

/* An array or map block count; a negative count is followed by the block's byte size (ignored). */
static int read_count(Reader *r, int64_t *out) {
    int64_t n, size;
    if (read_long(r, &n) < 0) return -1;
    if (n < 0) {
        if (n == INT64_MIN) return fail("block count out of range");
        n = -n;
        if (read_long(r, &size) < 0) return -1;
    }
    if (n > (int64_t)(r->end - r->p)) return fail("block count beyond the data");
    *out = n;
    return 0;
}

static PyObject *read_value(Reader *r, PyObject *prog);
static int skip_value(Reader *r, PyObject *prog);

static PyObject *read_record(Reader *r, PyObject *prog) {
    PyObject *cls = ARG(prog, 1), *names = ARG(prog, 2), *progs = ARG(prog, 3), *keep = ARG(prog, 4);
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (keep != Py_None && PyTuple_GET_ITEM(keep, i) != Py_True) {
            if (skip_value(r, PyTuple_GET_ITEM(progs, i)) < 0) goto error;
            continue;
        }
        PyObject *v = read_value(r, PyTuple_GET_ITEM(progs, i));
        if (v == NULL) goto error;
        int rc = PyDict_SetItem(d, PyTuple_GET_ITEM(names, i), v);
        Py_DECREF(v);
        if (rc < 0) goto error;
    }
    if (cls == Py_None) return d;
    {
        /* The frozen dataclass without its __init__: the program has typed every field. */
        PyTypeObject *type = (PyTypeObject *)cls;
        PyObject *obj = type->tp_new(type, empty_tuple, NULL);
        if (obj == NULL) goto error;
        if (PyObject_GenericSetDict(obj, d, NULL) < 0) {
            Py_DECREF(obj);
            goto error;
        }
        Py_DECREF(d);
        return obj;
    }
error:
    Py_DECREF(d);
    return NULL;
}

static PyObject *read_value(Reader *r, PyObject *prog) {
    int64_t n;
    Py_ssize_t len;
    switch (OP(prog)) {
    case OP_NULL:
        Py_RETURN_NONE;
    case OP_BOOLEAN:
        if (r->p >= r->end) { fail("truncated boolean"); return NULL; }
        if (*r->p > 1) { fail("boolean byte not 0 or 1"); return NULL; }
        return PyBool_FromLong(*r->p++);
    case OP_INT:
        if (read_long(r, &n) < 0) return NULL;
        if (n < INT32_MIN || n > INT32_MAX) { fail("int out of range"); return NULL; }
        return PyLong_FromLongLong(n);
    case OP_LONG:
        if (read_long(r, &n) < 0) return NULL;
        return PyLong_FromLongLong(n);
    case OP_FLOAT: {
        float f;
        if (r->end - r->p < 4) { fail("truncated float"); return NULL; }
        memcpy(&f, r->p, 4);  /* little-endian hosts only: checked at import */
        r->p += 4;
        return PyFloat_FromDouble((double)f);
    }
    case OP_DOUBLE: {
        double f;
        if (r->end - r->p < 8) { fail("truncated double"); return NULL; }
        memcpy(&f, r->p, 8);
        r->p += 8;
        return PyFloat_FromDouble(f);
    }
    case OP_BYTES: {
        if (read_length(r, &len) < 0) return NULL;
        PyObject *b = PyBytes_FromStringAndSize((const char *)r->p, len);
        r->p += len;
        return b;
    }
    case OP_STRING: {
        if (read_length(r, &len) < 0) return NULL;
        PyObject *s = PyUnicode_DecodeUTF8((const char *)r->p, len, NULL);
        if (s == NULL) { PyErr_Clear(); fail("string is not UTF-8"); return NULL; }
        r->p += len;
        return s;
    }
    case OP_RECORD:
        return read_record(r, prog);
    case OP_ENUM: {
        PyObject *symbols = ARG(prog, 1);
        if (read_long(r, &n) < 0) return NULL;
        if (n < 0 || n >= PyTuple_GET_SIZE(symbols)) { fail("enum index out of range"); return NULL; }
        PyObject *s = PyTuple_GET_ITEM(symbols, n);
        Py_INCREF(s);
        return s;
    }
    case OP_ARRAY: {
        PyObject *items = ARG(prog, 1), *list = PyList_New(0);
        if (list == NULL) return NULL;
        while (1) {
            if (read_count(r, &n) < 0) goto array_error;
            if (n == 0) break;
            for (int64_t i = 0; i < n; i++) {
                PyObject *v = read_value(r, items);
                if (v == NULL) goto array_error;
                int rc = PyList_Append(list, v);
                Py_DECREF(v);
                if (rc < 0) goto array_error;
            }
        }
        if (ARG(prog, 2) == Py_True) {
            PyObject *t = PyList_AsTuple(list);
            Py_DECREF(list);
            return t;
        }
        return list;
    array_error:
        Py_DECREF(list);
        return NULL;
    }
    case OP_MAP: {
        PyObject *values = ARG(prog, 1), *d = PyDict_New();
        if (d == NULL) return NULL;
        while (1) {
            if (read_count(r, &n) < 0) goto map_error;
            if (n == 0) break;
            for (int64_t i = 0; i < n; i++) {
                if (read_length(r, &len) < 0) goto map_error;
                PyObject *k = PyUnicode_DecodeUTF8((const char *)r->p, len, NULL);
                if (k == NULL) { PyErr_Clear(); fail("map key is not UTF-8"); goto map_error; }
                r->p += len;
                PyObject *v = read_value(r, values);
                if (v == NULL) { Py_DECREF(k); goto map_error; }
                int rc = PyDict_SetItem(d, k, v);
                Py_DECREF(k);
                Py_DECREF(v);
                if (rc < 0) goto map_error;
            }
        }
        return d;
    map_error:
        Py_DECREF(d);
        return NULL;
    }
    case OP_UNION: {
        PyObject *branches = ARG(prog, 1);
        if (read_long(r, &n) < 0) return NULL;
        if (n < 0 || n >= PyTuple_GET_SIZE(branches)) { fail("union index out of range"); return NULL; }
        return read_value(r, PyTuple_GET_ITEM(branches, n));
    }
    case OP_FIXED: {
        Py_ssize_t size = PyLong_AsSsize_t(ARG(prog, 1));
        if (r->end - r->p < size) { fail("truncated fixed"); return NULL; }
        PyObject *b = PyBytes_FromStringAndSize((const char *)r->p, size);
        r->p += size;
        return b;
    }
    }
    fail("unknown opcode");
    return NULL;
}

static int skip_value(Reader *r, PyObject *prog) {
    int64_t n;
    Py_ssize_t len;
    switch (OP(prog)) {
    case OP_NULL:
        return 0;
    case OP_BOOLEAN:
        if (r->p >= r->end) return fail("truncated boolean");
        r->p++;
        return 0;
    case OP_INT:
    case OP_LONG:
    case OP_ENUM:
        return read_long(r, &n);
    case OP_FLOAT:
        if (r->end - r->p < 4) return fail("truncated float");
        r->p += 4;
        return 0;
    case OP_DOUBLE:
        if (r->end - r->p < 8) return fail("truncated double");
        r->p += 8;
        return 0;
    case OP_BYTES:
    case OP_STRING:
        if (read_length(r, &len) < 0) return -1;
        r->p += len;
        return 0;
    case OP_RECORD: {
        PyObject *progs = ARG(prog, 3);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(progs); i++)
            if (skip_value(r, PyTuple_GET_ITEM(progs, i)) < 0) return -1;
        return 0;
    }
    case OP_ARRAY:
    case OP_MAP:
        while (1) {
            if (read_count(r, &n) < 0) return -1;
            if (n == 0) return 0;
            for (int64_t i = 0; i < n; i++) {
                if (OP(prog) == OP_MAP) {
                    if (read_length(r, &len) < 0) return -1;
                    r->p += len;
                }
                if (skip_value(r, ARG(prog, 1)) < 0) return -1;
            }
        }
    case OP_UNION: {
        PyObject *branches = ARG(prog, 1);
        if (read_long(r, &n) < 0) return -1;
        if (n < 0 || n >= PyTuple_GET_SIZE(branches)) return fail("union index out of range");
        return skip_value(r, PyTuple_GET_ITEM(branches, n));
    }
    case OP_FIXED: {
        Py_ssize_t size = PyLong_AsSsize_t(ARG(prog, 1));
        if (r->end - r->p < size) return fail("truncated fixed");
        r->p += size;
        return 0;
    }
    }
    return fail("unknown opcode");
}

static PyObject *avro_read(PyObject *self, PyObject *args) {
    PyObject *prog;
    Py_buffer view;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "O!y*n", &PyTuple_Type, &prog, &view, &pos)) return NULL;
    if (pos < 0 || pos > view.len) {
        PyBuffer_Release(&view);
        fail("position out of range");
        return NULL;
    }
    Reader r = {(const unsigned char *)view.buf + pos, (const unsigned char *)view.buf + view.len};
    PyObject *value = read_value(&r, prog);
    Py_ssize_t end = (Py_ssize_t)(r.p - (const unsigned char *)view.buf);
    PyBuffer_Release(&view);
    if (value == NULL) return NULL;
    PyObject *out = Py_BuildValue("(Nn)", value, end);
    return out;
}

/* ---- writing ------------------------------------------------------------------------------------ */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int reserve(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const void *src, Py_ssize_t n) {
    if (reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

static int put_long(Buf *b, int64_t v) {
    uint64_t n = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    if (reserve(b, 10) < 0) return -1;
    while (n >= 0x80) {
        b->data[b->len++] = (char)((n & 0x7f) | 0x80);
        n >>= 7;
    }
    b->data[b->len++] = (char)n;
    return 0;
}

static int as_int64(PyObject *value, int64_t *out) {
    if (!PyLong_Check(value)) return fail("not an int");
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow) return fail("int beyond 64 bits");
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static int write_value(Buf *b, PyObject *prog, PyObject *value);

/* Whether `value` is exactly of the branch's type (no coercion: ints are not doubles here). */
static int matches(PyObject *prog, PyObject *value) {
    switch (OP(prog)) {
    case OP_NULL: return value == Py_None;
    case OP_BOOLEAN: return PyBool_Check(value);
    case OP_INT:
    case OP_LONG: return PyLong_Check(value) && !PyBool_Check(value);
    case OP_FLOAT:
    case OP_DOUBLE: return PyFloat_Check(value);
    case OP_BYTES:
    case OP_FIXED: return PyBytes_Check(value);
    case OP_STRING:
    case OP_ENUM: return PyUnicode_Check(value);
    case OP_RECORD: {
        PyObject *cls = ARG(prog, 1);
        return (cls != Py_None && (PyObject *)Py_TYPE(value) == cls) || PyDict_CheckExact(value);
    }
    case OP_ARRAY: return PyList_Check(value) || PyTuple_Check(value);
    case OP_MAP: return PyDict_CheckExact(value);
    }
    return 0;
}

static int write_record(Buf *b, PyObject *prog, PyObject *value) {
    PyObject *cls = ARG(prog, 1), *names = ARG(prog, 2), *progs = ARG(prog, 3);
    PyObject *d;
    if (PyDict_CheckExact(value)) {
        d = value;
        Py_INCREF(d);
    } else if (cls != Py_None && (PyObject *)Py_TYPE(value) == cls) {
        d = PyObject_GenericGetDict(value, NULL);
        if (d == NULL) return -1;
    } else {
        return fail("record of another type");
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        PyObject *v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(names, i));
        if (v == NULL) {
            Py_DECREF(d);
            return PyErr_Occurred() ? -1 : fail("record field missing");
        }
        if (write_value(b, PyTuple_GET_ITEM(progs, i), v) < 0) {
            Py_DECREF(d);
            return -1;
        }
    }
    Py_DECREF(d);
    return 0;
}

static int write_value(Buf *b, PyObject *prog, PyObject *value) {
    int64_t n;
    Py_ssize_t len;
    switch (OP(prog)) {
    case OP_NULL:
        return value == Py_None ? 0 : fail("not None");
    case OP_BOOLEAN: {
        if (!PyBool_Check(value)) return fail("not a bool");
        char c = value == Py_True;
        return put(b, &c, 1);
    }
    case OP_INT:
        if (as_int64(value, &n) < 0) return -1;
        if (n < INT32_MIN || n > INT32_MAX) return fail("int out of range");
        return put_long(b, n);
    case OP_LONG:
        if (as_int64(value, &n) < 0) return -1;
        return put_long(b, n);
    case OP_FLOAT: {
        if (!PyFloat_Check(value)) return fail("not a float");
        double d = PyFloat_AS_DOUBLE(value);
        if (d == d && (d > FLT_MAX || d < -FLT_MAX) && d != Py_HUGE_VAL && d != -Py_HUGE_VAL)
            return fail("float out of range");
        float f = (float)d;
        return put(b, &f, 4);
    }
    case OP_DOUBLE: {
        if (!PyFloat_Check(value)) return fail("not a float");
        double d = PyFloat_AS_DOUBLE(value);
        return put(b, &d, 8);
    }
    case OP_BYTES:
        if (!PyBytes_CheckExact(value)) return fail("not bytes");
        len = PyBytes_GET_SIZE(value);
        if (put_long(b, len) < 0) return -1;
        return put(b, PyBytes_AS_STRING(value), len);
    case OP_STRING: {
        if (!PyUnicode_CheckExact(value)) return fail("not a str");
        const char *s = PyUnicode_AsUTF8AndSize(value, &len);
        if (s == NULL) {
            PyErr_Clear();
            return fail("str not encodable as UTF-8");
        }
        if (put_long(b, len) < 0) return -1;
        return put(b, s, len);
    }
    case OP_RECORD:
        return write_record(b, prog, value);
    case OP_ENUM: {
        PyObject *symbols = ARG(prog, 1);
        if (!PyUnicode_CheckExact(value)) return fail("enum symbol not a str");
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(symbols); i++) {
            int eq = PyUnicode_Compare(value, PyTuple_GET_ITEM(symbols, i));
            if (eq == -1 && PyErr_Occurred()) return -1;
            if (eq == 0) return put_long(b, i);
        }
        return fail("not a symbol of the enum");
    }
    case OP_ARRAY: {
        if (!PyList_CheckExact(value) && !PyTuple_CheckExact(value)) return fail("not a list or tuple");
        PyObject *seq = value;
        len = PySequence_Fast_GET_SIZE(seq);
        if (len > 0) {
            if (put_long(b, len) < 0) return -1;
            for (Py_ssize_t i = 0; i < len; i++)
                if (write_value(b, ARG(prog, 1), PySequence_Fast_GET_ITEM(seq, i)) < 0) return -1;
        }
        return put_long(b, 0);
    }
    case OP_MAP: {
        if (!PyDict_CheckExact(value)) return fail("not a dict");
        len = PyDict_GET_SIZE(value);
        if (len > 0) {
            PyObject *k, *v;
            Py_ssize_t pos = 0;
            if (put_long(b, len) < 0) return -1;
            while (PyDict_Next(value, &pos, &k, &v)) {
                if (write_value(b, ARG(prog, 2), k) < 0) return -1;
                if (write_value(b, ARG(prog, 1), v) < 0) return -1;
            }
        }
        return put_long(b, 0);
    }
    case OP_UNION: {
        PyObject *branches = ARG(prog, 1);
        Py_ssize_t found = -1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(branches); i++) {
            if (matches(PyTuple_GET_ITEM(branches, i), value)) {
                if (found >= 0) return fail("value matches two branches of the union");
                found = i;
            }
        }
        if (found < 0) return fail("value matches no branch of the union");
        if (put_long(b, found) < 0) return -1;
        return write_value(b, PyTuple_GET_ITEM(branches, found), value);
    }
    case OP_FIXED: {
        Py_ssize_t size = PyLong_AsSsize_t(ARG(prog, 1));
        if (!PyBytes_CheckExact(value) || PyBytes_GET_SIZE(value) != size) return fail("not bytes of the fixed size");
        return put(b, PyBytes_AS_STRING(value), size);
    }
    }
    return fail("unknown opcode");
}

static PyObject *avro_write(PyObject *self, PyObject *args) {
    PyObject *prog, *value;
    Py_buffer prefix;
    if (!PyArg_ParseTuple(args, "O!Oy*", &PyTuple_Type, &prog, &value, &prefix)) return NULL;
    Buf b = {NULL, 0, 0};
    PyObject *out = NULL;
    if (put(&b, prefix.buf, prefix.len) == 0 && write_value(&b, prog, value) == 0)
        out = PyBytes_FromStringAndSize(b.data, b.len);
    PyBuffer_Release(&prefix);
    PyMem_Free(b.data);
    return out;
}

static PyMethodDef methods[] = {
    {"read", avro_read, METH_VARARGS, "read(program, data, pos) -> (value, end)"},
    {"write", avro_write, METH_VARARGS, "write(program, value, prefix) -> prefix + the value's encoding"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_avrobin", NULL, -1, methods};

PyMODINIT_FUNC PyInit__avrobin(void) {
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "_avrobin reads and writes floats as little-endian only");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    empty_tuple = PyTuple_New(0);
    Unsupported = PyErr_NewException("_avrobin.Unsupported", PyExc_ValueError, NULL);
    if (empty_tuple == NULL || Unsupported == NULL || PyModule_AddObjectRef(m, "Unsupported", Unsupported) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
