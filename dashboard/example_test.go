package dashboard_test

import (
	"crypto/subtle"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"

	"github.com/idemkit/idem/dashboard"
	"github.com/idemkit/idem/internal/testdb"
)

// requireOperator is your own authentication; here, HTTP basic auth.
func requireOperator(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		if !ok || subtle.ConstantTimeCompare([]byte(user+":"+pass), []byte("ops:s3cret")) != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="idem"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// The dashboard mounted under a prefix of the application's own server,
// behind its authentication.
func ExampleNew() {
	pool, done := testdb.ExamplePool()
	defer done()
	mux := http.NewServeMux()

	d, err := dashboard.New(dashboard.Config{Pool: pool, Prefix: "/ops/idem"})
	if err != nil {
		log.Fatal(err)
	}
	mux.Handle("/ops/idem/", requireOperator(d))

	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, auth := range []bool{false, true} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/ops/idem/maintenance", nil)
		if auth {
			req.SetBasicAuth("ops", "s3cret")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		fmt.Println(resp.Status)
	}
	// Output:
	// 401 Unauthorized
	// 200 OK
}
