package idemhttp

import (
	"bytes"
	"net/http"
)

func newReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// recorder holds the handler's answer so that it can be stored before it
// is sent. Up to max bytes of body are buffered and sent once the handler
// returns. Past max bytes, or when the handler flushes (http.Flusher,
// http.ResponseController), the status, the headers and what is buffered
// are sent at once and the rest streams to the client as the handler
// writes it; an answer over max is stored without its body (overflow), so
// at most max bytes of it are ever held in memory.
//
// Informational answers (1xx but 101) are sent to the client as the
// handler writes them and are never taken for the final status: a handler
// that sends 103 Early Hints and then 500 answered 500.
type recorder struct {
	w        http.ResponseWriter // the client's
	header   http.Header         // the handler's headers
	code     int                 // the final status, 0 until one is written
	body     bytes.Buffer        // the body, while it is under max
	max      int
	overflow bool        // the body is over max: it is not stored
	sent     bool        // status and headers went to the client: the rest streams
	sentHdr  http.Header // the headers as they were sent
	n        int64       // body bytes written by the handler
}

func newRecorder(w http.ResponseWriter, max int) *recorder {
	return &recorder{w: w, header: http.Header{}, max: max}
}

func (r *recorder) Header() http.Header { return r.header }

// informational reports a 1xx status that is not final (101 Switching
// Protocols is, as net/http treats it).
func informational(code int) bool {
	return code >= 100 && code < 200 && code != http.StatusSwitchingProtocols
}

func (r *recorder) WriteHeader(code int) {
	if r.code != 0 {
		return // superfluous, as net/http has it
	}
	if informational(code) {
		// Sent now with the headers set so far, as net/http sends them.
		r.copyHeader()
		r.w.WriteHeader(code)
		return
	}
	r.code = code
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	r.n += int64(len(p))
	if !r.overflow && r.body.Len()+len(p) > r.max {
		// Over the cap: not stored, and no longer held; what was
		// buffered goes out first.
		r.overflow = true
		r.send()
		r.body = bytes.Buffer{}
	}
	if !r.overflow {
		r.body.Write(p)
	}
	if r.sent {
		return r.w.Write(p)
	}
	return len(p), nil
}

// FlushError sends what the handler wrote so far (net/http's Flush
// commits the status: 200 when none was written). It is what
// http.ResponseController.Flush calls.
func (r *recorder) FlushError() error {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	r.send()
	return http.NewResponseController(r.w).Flush()
}

// Flush is http.Flusher's.
func (r *recorder) Flush() { _ = r.FlushError() }

// send commits the status and headers to the client, with the body
// buffered so far (and still held while it is under max, to be stored).
func (r *recorder) send() {
	if r.sent {
		return
	}
	r.sent = true
	r.copyHeader()
	r.sentHdr = r.header.Clone()
	r.w.WriteHeader(r.status())
	if r.body.Len() > 0 {
		_, _ = r.w.Write(r.body.Bytes())
	}
}

// copyHeader sets the handler's headers on the client's (headers an
// outer middleware set stay, unless the handler set them too).
func (r *recorder) copyHeader() {
	h := r.w.Header()
	for k, v := range r.header {
		h[k] = v
	}
}

func (r *recorder) status() int {
	if r.code == 0 {
		return http.StatusOK
	}
	return r.code
}

// storedHeader is the header that goes with the stored answer: the one
// sent, if the answer was streamed.
func (r *recorder) storedHeader() http.Header {
	if r.sent {
		return r.sentHdr
	}
	return r.header
}

func (r *recorder) written() bool { return r.code != 0 || r.n > 0 }

// flushTo sends the answer, or the rest of it when it was streamed.
func (r *recorder) flushTo() {
	r.send()
}
