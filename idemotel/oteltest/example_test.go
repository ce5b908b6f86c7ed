package oteltest_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/internal/testdb"
)

// One TracerProvider for otelhttp, otelpgx and idemotel: idem's spans
// nest under the request's server span, and pgx's under idem's. A
// delivery and its duplicate.
func Example() {
	ctx := context.Background()
	url, drop, err := testdb.Create() // in an application: os.Getenv("DATABASE_URL")
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	recorder := tracetest.NewSpanRecorder()
	// In an application: the providers it already has (an OTLP exporter).
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))

	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		log.Fatal(err)
	}
	cfg.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithTracerProvider(tp))
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	tel, err := idemotel.New(&idemotel.Config{TracerProvider: tp, MeterProvider: mp})
	if err != nil {
		log.Fatal(err)
	}
	client, err := idem.New(pool, &idem.Config{Tracer: tel})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "orders",
		// The principal your authentication decided; Unscoped: keys shared by all callers.
		Scope: idemhttp.Unscoped})
	if err != nil {
		log.Fatal(err)
	}
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The receipt is sent once per order, however often the request comes.
		if _, err := client.Effect(r.Context(), "send_receipt", func(ctx context.Context) (any, error) {
			return "sent", nil // in an application: the mail API's call, through idemhttp.Transport
		}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	handler := otelhttp.NewHandler(mw(orders), "orders", otelhttp.WithTracerProvider(tp))

	srv := httptest.NewServer(handler) // in an application: http.ListenAndServe(":8080", handler)
	defer srv.Close()
	for range 2 {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "order-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		var names []string
		for _, s := range recorder.Ended() {
			if strings.HasPrefix(s.Name(), "idem.") {
				names = append(names, s.Name())
			}
		}
		fmt.Println(strings.Join(names, " "))
		recorder.Reset()
	}
	// Output:
	// idem.claim idem.claim idem.work idem.complete idem.effect idem.work idem.complete idem.do
	// idem.claim idem.do
}
