package receiver

import (
	"encoding/json"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
)

// newWebhookHandler is the receiver under test (docs/receiver_test.go's):
// it books a Stripe invoice.paid event's payment; run twice, it would fail
// on the primary key, and the test would see it.
func newWebhookHandler(pool *pgxpool.Pool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var ev struct {
			Data struct {
				Object struct {
					ID         string `json:"id"`
					AmountPaid int64  `json:"amount_paid"`
				} `json:"object"`
			} `json:"data"`
		}
		if err := json.NewDecoder(r.Body).Decode(&ev); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if _, err := pool.Exec(r.Context(), `INSERT INTO payments VALUES ($1, $2)`, ev.Data.Object.ID, ev.Data.Object.AmountPaid); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
}
