package idemhttp

import (
	"bytes"
	"net/http"
)

func newReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// recorder buffers the handler's response so that it can be stored before
// it is sent. The whole body is buffered (it is sent in full); past max
// bytes, overflow is set and the body is not stored.
type recorder struct {
	header   http.Header
	code     int
	body     bytes.Buffer
	max      int
	overflow bool
}

func newRecorder(max int) *recorder { return &recorder{header: http.Header{}, max: max} }

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	if r.body.Len()+len(p) > r.max {
		r.overflow = true
	}
	return r.body.Write(p)
}

func (r *recorder) status() int {
	if r.code == 0 {
		return http.StatusOK
	}
	return r.code
}

func (r *recorder) written() bool { return r.code != 0 || r.body.Len() > 0 }

// flushTo sends the buffered response.
func (r *recorder) flushTo(w http.ResponseWriter) {
	for k, v := range r.header {
		w.Header()[k] = v
	}
	w.WriteHeader(r.status())
	_, _ = w.Write(r.body.Bytes())
}
